"""draft_proposer: k draft tokens per sequence from a draft model, a draft head or n-gram lookup.

Keeps each live sequence (its tokens, and a KV cache with method draft_model); a
propose request carries only the tokens not sent before, at ``position``, and a
request with ``release`` set frees the sequence. A request carries one or more
sequences (``wire``), and requests arrive in dynamic batches, so with the fast engine
all sequences drafting at the same moment share each forward. A request with
``describe`` set gets the proposer's ``ModelDescription``, which the orchestrator
checks against the target's; a head (eagle3, mlp_speculator) names there the target hidden
states it reads, which the orchestrator then asks target_verifier for and sends along.
"""

from specdec.build import build_lm
from specdec.cached_lm import describe_lm
from specdec.heads import HEAD_METHODS, build_head_proposer, describe_head
from specdec.proposers import NGRAM_DESCRIPTION, DraftModelProposer, NgramProposer
from specdec_triton import hidden_wire, wire
from specdec_triton.configs import DraftProposerConfig
from specdec_triton.internal import boot_secret
from specdec_triton.metrics import ActiveSequences
from specdec_triton.plumbing import ModelLogger, Parameters, answer_batch, instance_device


class TritonPythonModel:
    def initialize(self, args):
        self.logger = ModelLogger(args["model_name"])
        config, device = DraftProposerConfig.from_parameters(Parameters.from_args(args)), instance_device(args)
        if config.method == "ngram":
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
            self.description = NGRAM_DESCRIPTION
        elif config.method in HEAD_METHODS:
            self.proposer = build_head_proposer(
                config.method, config.draft_model, config.target_model, config.dtype, device, config.max_num_seqs
            )
            self.description = describe_head(self.proposer, config.draft_model)
        else:
            lm = build_lm(config.draft_model, config.engine, config.dtype, device, config.max_num_seqs)
            self.proposer, self.description = DraftModelProposer(lm), describe_lm(lm, config.draft_model, "draft_model")
        self.active = ActiveSequences(args["model_name"])
        self.name, self.secret = args["model_name"], boot_secret()  # only the orchestrator may call
        self.logger.info(f"{config} on {device}: {self.description}")
        for warning in config.unread_settings():
            self.logger.warning(warning)

    def finalize(self):
        self.logger.info("unloaded")

    def execute(self, requests):
        responses = answer_batch(requests, wire.PROPOSE_INPUTS + hidden_wire.PROPOSE_HIDDEN_INPUTS, self._propose)
        self.active.set(self.proposer.num_active_sequences)
        return responses

    def _propose(self, batch):
        """Releases first, then every sequence of every propose request in one ``propose`` call."""
        for inputs in batch:
            if not wire.is_describe(inputs):
                wire.check_caller(inputs, self.secret, self.name)
        for inputs in batch:
            if wire.is_release(inputs):
                for seq_id in wire.seq_ids_of(inputs):
                    self.proposer.release(seq_id)
        requests = [[] if wire.is_describe(x) or wire.is_release(x)
                    else hidden_wire.with_hidden_states(wire.propose_requests_of(x), x) for x in batch]  # fmt: skip
        proposals = iter(self.proposer.propose([r for group in requests for r in group]))
        return [
            {**wire.description_outputs(self.description), **hidden_wire.description_hidden_outputs(self.description)}
            if wire.is_describe(inputs)
            else wire.proposal_outputs([next(proposals) for _ in group])
            for inputs, group in zip(batch, requests)
        ]  # fmt: skip
