"""MTP proposer: the target's own multi-token-prediction layer (``specdec.heads.mtp``) drafts k tokens.

The layer reads what an EAGLE-3 head reads, one hidden state of the target per verified
position (its final one) beside the next token, runs one decoder block with its own KV cache,
and feeds itself its pre-norm output to draft further: ``Eagle3Proposer``'s sequences, feature
buffer, cut-back of rolled-back rows, greedy on-device chain and sampled chain (``q`` returned)
serve it unchanged. k drafts chain the one layer k times (vLLM's proposer does the same).
Trees are refused: vLLM drafts MTP as a chain, and ``specdec.methods`` declares none.
"""
from __future__ import annotations

from specdec.heads.mtp import MTPHead
from specdec.proposers.eagle3 import Eagle3Proposer


class MTPProposer(Eagle3Proposer):
    method = "mtp"
    head_name = "MTP layer"

    def __init__(self, head: MTPHead, max_num_seqs: int = 8, max_model_len: int | None = None,
                 cpu_compile: bool = False, cuda_graphs: bool | None = None, log=None):  # fmt: skip
        super().__init__(head, max_num_seqs, max_model_len, cpu_compile, cuda_graphs, tree=None, log=log)
