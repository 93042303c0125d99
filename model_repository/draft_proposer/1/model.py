"""draft_proposer: k draft tokens per sequence from a draft model or n-gram lookup.

Holds a KV cache per live sequence (method draft_model); a request with ``release``
set frees one. A request carries one or more sequences (``wire``), and requests arrive in dynamic
batches, so with the fast engine all sequences drafting at the same moment share each
forward. A request with ``measure_call_costs`` set also gets what a propose call of
each shape costs, measured on scratch sequences the first time it is asked
(``specdec.call_costs``), for the orchestrator's adaptive speculation length.
"""

from specdec.call_costs import MeasuredOnce, measure_propose_costs
from specdec.fast import FastDraftProposer
from specdec.models import load_causal_lm
from specdec.proposers import DraftModelProposer, NgramProposer
from specdec_triton import wire
from specdec_triton.configs import DraftProposerConfig
from specdec_triton.metrics import ActiveSequences
from specdec_triton.plumbing import ModelLogger, Parameters, answer_batch, instance_device


class TritonPythonModel:
    def initialize(self, args):
        self.logger = ModelLogger(args["model_name"])
        config, device = DraftProposerConfig.from_parameters(Parameters.from_args(args)), instance_device(args)
        self.max_num_seqs = None  # n-gram lookup holds no per-sequence state
        if config.method == "ngram":
            self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        elif config.engine == "fast":
            self.proposer = FastDraftProposer(config.draft_model, config.dtype, device, config.max_num_seqs)
            self.max_num_seqs = config.max_num_seqs
        else:
            self.proposer = DraftModelProposer(load_causal_lm(config.draft_model, config.dtype, device), device)
            self.max_num_seqs = config.max_num_seqs
        self.active = ActiveSequences(args["model_name"])
        vocab_size = getattr(self.proposer, "vocab_size", None)  # n-gram lookup has no vocabulary
        self.call_costs = MeasuredOnce(
            "propose", lambda: measure_propose_costs(self.proposer, config.max_num_seqs, vocab_size), self.logger.info
        )
        self.logger.info(f"{config} on {device}")
        for warning in config.unread_settings():
            self.logger.warning(warning)

    def execute(self, requests):
        responses = answer_batch(requests, wire.PROPOSE_INPUTS, self._propose)
        self.active.set(getattr(self.proposer, "num_active_sequences", 0))
        return responses

    def _propose(self, batch):
        """Releases first, then every sequence of every propose request in one ``propose`` call."""
        for inputs in batch:
            if wire.is_release(inputs):
                for seq_id in wire.seq_ids_of(inputs):
                    self.proposer.release(seq_id)
        requests = [[] if wire.is_release(inputs) else wire.propose_requests_of(inputs) for inputs in batch]
        proposals = iter(self.proposer.propose([r for group in requests for r in group]))
        outputs = [wire.proposal_outputs([next(proposals) for _ in group], self.max_num_seqs) for group in requests]
        return wire.add_call_costs(batch, outputs, self.call_costs)
