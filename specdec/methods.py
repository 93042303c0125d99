"""Every drafting method, declared once: what kind of drafter it is decides where it runs and how it is built.

* ``model``: a causal LM with its own KV cache (``specdec.proposers.draft_model``), run in
  its own model (draft_proposer) or with the target (``run_with_target``);
* ``head``: a module on the target's hidden states (``specdec.heads``), placed as a model is;
  with the target its hidden states never leave the target's process;
* ``model_free``: reads nothing but the sequence's tokens, so the orchestrator, which holds
  them, runs it (``specdec.proposers.model_free``); draft_proposer only describes its settings.

Adding a method (``docs/engine.md``, "Adding a method"): its proposer in one file of
``specdec/proposers/`` behind the ``Proposer`` protocol, a head's module and loader in
``specdec/heads/`` for a head, and one entry here and in ``PROPOSERS``. Serving,
``speculative_config``, the benchmarks and the configuration checks read the kind from here.
"""
from __future__ import annotations

from dataclasses import dataclass

MODEL, HEAD, MODEL_FREE = "model", "head", "model_free"


@dataclass(frozen=True)
class Method:
    name: str  # draft_proposer's ``method``, vLLM's ``speculative_config`` ``method``
    kind: str  # MODEL | HEAD | MODEL_FREE
    # drafts a static ``speculative_token_tree`` (``specdec.tree``); suffix decoding grows its own trees instead
    drafts_static_trees: bool = False
    drafts_dynamic_trees: bool = False  # EAGLE-2's dynamic tree (specdec.tree.DynamicTree)
    # a head whose weights are the target's own (MTP layers): read from the target's checkpoint, no model path
    in_target_checkpoint: bool = False
    # drafts k tokens in one forward from mask tokens (vLLM's ``parallel_drafting``) when its checkpoint
    # was trained for it: a PARD draft model (specdec.proposers.pard), a P-EAGLE head (specdec.proposers.peagle)
    parallel_drafting: bool = False

    def __post_init__(self):
        if self.kind not in (MODEL, HEAD, MODEL_FREE):
            raise ValueError(f"method {self.name!r}: kind must be one of {(MODEL, HEAD, MODEL_FREE)}, got {self.kind!r}")


METHODS = {
    m.name: m
    for m in (
        Method("draft_model", MODEL, drafts_static_trees=True, parallel_drafting=True),
        Method("ngram", MODEL_FREE),
        Method("suffix", MODEL_FREE),
        Method("eagle3", HEAD, drafts_static_trees=True, drafts_dynamic_trees=True,
               parallel_drafting=True),  # parallel: a P-EAGLE head (specdec.heads.peagle)
        Method("mlp_speculator", HEAD, drafts_static_trees=True),
        Method("medusa", HEAD, drafts_static_trees=True),
        Method("mtp", HEAD, in_target_checkpoint=True),
        Method("dflash", HEAD),  # a block of drafts from one pass (specdec.heads.dflash)
    )
}


def names_of(kind: str) -> tuple[str, ...]:
    """The methods of one kind, in declaration order."""
    return tuple(name for name, method in METHODS.items() if method.kind == kind)
