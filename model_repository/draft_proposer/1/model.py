"""draft_proposer: k draft tokens per sequence from a draft model or n-gram lookup.

Holds a KV cache per live sequence (method draft_model); a request with ``release``
set frees one. Requests arrive in dynamic batches (one item per request), so with the
fast engine all sequences drafting at the same moment share each forward.
"""
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
        self.logger.info(f"{config} on {device}")

    def execute(self, requests):
        responses = answer_batch(requests, wire.PROPOSE_INPUTS, self._propose)
        self.active.set(getattr(self.proposer, "num_active_sequences", 0))
        return responses

    def _propose(self, batch):
        """Releases first, then every propose request of the batch in one ``propose`` call."""
        for inputs in batch:
            if wire.is_release(inputs):
                self.proposer.release(wire.seq_id_of(inputs))
        work = [i for i, inputs in enumerate(batch) if not wire.is_release(inputs)]
        proposals = dict(zip(work, self.proposer.propose([wire.propose_request_of(batch[i]) for i in work])))
        return [wire.proposal_outputs(proposals.get(i), self.max_num_seqs) for i in range(len(batch))]
