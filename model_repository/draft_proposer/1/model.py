"""draft_proposer: k draft tokens per sequence from a draft model, n-gram lookup or suffix trees.

Keeps each live sequence (its tokens, and a KV cache with method draft_model); a
propose request carries only the tokens not sent before, at ``position``, and a
request with ``release`` set frees the sequence. A request carries one or more
sequences (``wire``), and requests arrive in dynamic batches, so with the fast engine
all sequences drafting at the same moment share each forward. A request with
``describe`` set gets the proposer's ``ModelDescription``, which the orchestrator
checks against the target's.
"""

from specdec.build import build_lm
from specdec.cached_lm import describe_lm
from specdec.proposers import NGRAM_DESCRIPTION, SUFFIX_DESCRIPTION, DraftModelProposer, NgramProposer, SuffixProposer
from specdec_triton import wire
from specdec_triton.configs import DraftProposerConfig
from specdec_triton.internal import boot_secret
from specdec_triton.metrics import ActiveSequences, SuffixCacheGauges
from specdec_triton.plumbing import ModelLogger, Parameters, answer_batch, instance_device


class TritonPythonModel:
    def initialize(self, args):
        self.logger = ModelLogger(args["model_name"])
        config, device = DraftProposerConfig.from_parameters(Parameters.from_args(args)), instance_device(args)
        if config.method == "ngram":
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
            self.description = NGRAM_DESCRIPTION
        elif config.method == "suffix":
            self.proposer, self.description = SuffixProposer(config.suffix), SUFFIX_DESCRIPTION
        else:
            lm = build_lm(config.draft_model, config.engine, config.dtype, device, config.max_num_seqs, log=self.logger.info)
            self.proposer, self.description = DraftModelProposer(lm), describe_lm(lm, config.draft_model, "draft_model")
        self.active = ActiveSequences(args["model_name"])
        self.suffix_gauges = SuffixCacheGauges(args["model_name"]) if config.method == "suffix" else None
        self.name, self.secret = args["model_name"], boot_secret()  # only the orchestrator may call
        self.logger.info(f"{config} on {device}: {self.description}")
        for warning in config.unread_settings():
            self.logger.warning(warning)

    def finalize(self):
        self.logger.info("unloaded")

    def execute(self, requests):
        responses = answer_batch(requests, wire.PROPOSE_INPUTS, self._propose)
        self.active.set(self.proposer.num_active_sequences)
        if self.suffix_gauges is not None:
            stats = self.proposer.stats()
            self.suffix_gauges.set(stats.cached_responses, stats.tree_nodes, stats.approx_bytes)
        return responses

    def _propose(self, batch):
        """Releases first, then every sequence of every propose request in one ``propose`` call."""
        for inputs in batch:
            if not wire.is_describe(inputs):
                wire.check_caller(inputs, self.secret, self.name)
        for inputs in batch:
            if wire.is_release(inputs):  # with the responses of the requests that completed
                for seq_id, response in zip(wire.seq_ids_of(inputs), wire.responses_of(inputs)):
                    self.proposer.release(seq_id, response or None)
        requests = [[] if wire.is_describe(x) or wire.is_release(x) else wire.propose_requests_of(x) for x in batch]
        proposals = iter(self.proposer.propose([r for group in requests for r in group]))
        return [
            wire.description_outputs(self.description) if wire.is_describe(inputs)
            else wire.proposal_outputs([next(proposals) for _ in group])
            for inputs, group in zip(batch, requests)
        ]  # fmt: skip
