"""target_verifier: one target forward scores the last token and k drafts of every sequence in a batch.

Holds the KV cache of every live sequence; a request with ``release`` set frees one.
Requests arrive in dynamic batches (one item per request), so with the fast engine
all sequences verifying at the same moment share one forward. Every response also
reports ``max_model_len``, ``vocab_size`` and ``max_num_seqs``, which the orchestrator
checks requests against.
"""
from specdec.fast import FastTargetVerifier
from specdec.models import load_causal_lm
from specdec.verifier import TargetVerifier
from specdec_triton import wire
from specdec_triton.configs import TargetVerifierConfig
from specdec_triton.metrics import ActiveSequences
from specdec_triton.plumbing import ModelLogger, Parameters, answer_batch, instance_device


class TritonPythonModel:
    def initialize(self, args):
        self.logger = ModelLogger(args["model_name"])
        self.config = TargetVerifierConfig.from_parameters(Parameters.from_args(args))
        config, device = self.config, instance_device(args)
        if config.engine == "fast":
            self.verifier = FastTargetVerifier(
                config.target_model, config.dtype, device, config.max_num_seqs, config.max_model_len
            )
        else:
            model = load_causal_lm(config.target_model, config.dtype, device)
            self.verifier = TargetVerifier(model, device, config.max_model_len)
        self.active = ActiveSequences(args["model_name"])
        self.logger.info(f"{config} on {device}: max_model_len {self.verifier.max_model_len}")

    def execute(self, requests):
        responses = answer_batch(requests, wire.VERIFY_INPUTS, self._verify)
        self.active.set(self.verifier.num_active_sequences)
        return responses

    def _verify(self, batch):
        """Releases first, then every verify request of the batch in one ``verify`` call."""
        for inputs in batch:
            if wire.is_release(inputs):
                self.verifier.release(wire.seq_id_of(inputs))
        work = [i for i, inputs in enumerate(batch) if not wire.is_release(inputs)]
        results = dict(zip(work, self.verifier.verify([wire.verify_request_of(batch[i]) for i in work])))
        limits = (self.verifier.max_model_len, self.verifier.vocab_size, self.config.max_num_seqs)
        return [wire.verify_outputs(results.get(i), *limits) for i in range(len(batch))]
