"""target_verifier: one target forward scores the last token and k drafts of every sequence in a batch.

Holds the KV cache of every live sequence; a request with ``release`` set frees one.
A request carries one or more sequences (``wire``), and requests arrive in dynamic
batches, so with the fast engine all sequences verifying at the same moment share one
forward. Every response also
reports ``max_model_len``, ``vocab_size`` and ``max_num_seqs``, which the orchestrator
checks requests against. A request with ``measure_call_costs`` set also gets what a
verify call of each shape costs, measured on scratch sequences the first time it is
asked (``specdec.call_costs``), for the orchestrator's adaptive speculation length.
"""

from specdec.call_costs import MeasuredOnce, measure_verify_costs
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
        self.call_costs = MeasuredOnce(
            "verify",
            lambda: measure_verify_costs(self.verifier, config.max_num_seqs, self.verifier.vocab_size),
            self.logger.info,
        )
        self.logger.info(f"{config} on {device}: max_model_len {self.verifier.max_model_len}")

    def execute(self, requests):
        responses = answer_batch(requests, wire.VERIFY_INPUTS, self._verify)
        self.active.set(self.verifier.num_active_sequences)
        return responses

    def _verify(self, batch):
        """Releases first, then every sequence of every verify request in one ``verify`` call."""
        for inputs in batch:
            if wire.is_release(inputs):
                for seq_id in wire.seq_ids_of(inputs):
                    self.verifier.release(seq_id)
        requests = [[] if wire.is_release(inputs) else wire.verify_requests_of(inputs) for inputs in batch]
        results = iter(self.verifier.verify([r for group in requests for r in group]))
        limits = (self.verifier.max_model_len, self.verifier.vocab_size, self.config.max_num_seqs)
        outputs = [wire.verify_outputs([next(results) for _ in group], *limits) for group in requests]
        return wire.add_call_costs(batch, outputs, self.call_costs)
