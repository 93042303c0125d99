"""target_verifier: one target forward scores the last token and k drafts of every sequence in a batch.

Holds the KV cache of every live sequence; a request with ``release`` set frees one.
A request carries one or more sequences (``wire``), and requests arrive in dynamic
batches, so with the fast engine all sequences verifying at the same moment share one
forward. A request with ``describe`` set gets the target's ``ModelDescription``
(checkpoint, vocabulary, ``max_model_len``, ``max_num_seqs``), which the orchestrator
checks requests and the draft against.
"""

from specdec.build import build_lm
from specdec.cached_lm import describe_lm
from specdec.verifier import TargetVerifier
from specdec_triton import hidden_wire, wire
from specdec_triton.configs import TargetVerifierConfig
from specdec_triton.internal import boot_secret
from specdec_triton.metrics import ActiveSequences
from specdec_triton.plumbing import ModelLogger, Parameters, answer_batch, instance_device


def _outputs(results):
    """A draft head's hidden states travel back only to a request that asked for them."""
    return {**wire.verify_outputs(results), **hidden_wire.hidden_outputs(results)}


class TritonPythonModel:
    def initialize(self, args):
        self.logger = ModelLogger(args["model_name"])
        config, device = TargetVerifierConfig.from_parameters(Parameters.from_args(args)), instance_device(args)
        lm = build_lm(config.target_model, config.engine, config.dtype, device, config.max_num_seqs, config.max_model_len)
        self.verifier, self.description = TargetVerifier(lm), describe_lm(lm, config.target_model, "target")
        self.active = ActiveSequences(args["model_name"])
        self.name, self.secret = args["model_name"], boot_secret()  # only the orchestrator may call
        self.logger.info(f"{config} on {device}: {self.description}")

    def finalize(self):
        self.logger.info("unloaded")

    def execute(self, requests):
        responses = answer_batch(requests, wire.VERIFY_INPUTS + hidden_wire.VERIFY_HIDDEN_INPUTS, self._verify)
        self.active.set(self.verifier.num_active_sequences)
        return responses

    def _verify(self, batch):
        """Releases first, then every sequence of every verify request in one ``verify`` call."""
        for inputs in batch:
            if not wire.is_describe(inputs):
                wire.check_caller(inputs, self.secret, self.name)
        for inputs in batch:
            if wire.is_release(inputs):
                for seq_id in wire.seq_ids_of(inputs):
                    self.verifier.release(seq_id)
        requests = [[] if wire.is_describe(x) or wire.is_release(x)
                    else hidden_wire.with_hidden_layers(wire.verify_requests_of(x), x) for x in batch]  # fmt: skip
        results = iter(self.verifier.verify([r for group in requests for r in group]))
        return [
            wire.description_outputs(self.description) if wire.is_describe(inputs)
            else _outputs([next(results) for _ in group])
            for inputs, group in zip(batch, requests)
        ]  # fmt: skip
