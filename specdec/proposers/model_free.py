"""Model-free proposers (n-gram lookup, suffix decoding), described by their settings and rebuilt from them.

They read nothing but each sequence's tokens, and the orchestrator holds those
already. Run there, a step's proposal costs the lookup alone; run in the
draft_proposer model it costs a BLS round trip besides (the request, the new tokens,
the response), which on a CPU server is as much as the lookup saves on a step where it
drafts nothing. So the draft_proposer model stays the place these methods are
configured, and its description carries the settings
(:attr:`~specdec.types.ModelDescription.settings`); the orchestrator builds the same
proposer from them (:func:`model_free_proposer`) and owns its state from then on.
"""
from __future__ import annotations

from dataclasses import asdict, fields, replace

from specdec.proposers.base import Proposer
from specdec.proposers.ngram import NGRAM_DESCRIPTION, NgramConfig, NgramProposer
from specdec.proposers.suffix import SUFFIX_DESCRIPTION, SuffixConfig, SuffixProposer
from specdec.types import ModelDescription

MODEL_FREE_METHODS = {
    # method -> (its settings, the proposer built from them, its description without settings)
    "ngram": (NgramConfig, lambda c: NgramProposer(c.prompt_lookup_min, c.prompt_lookup_max), NGRAM_DESCRIPTION),
    "suffix": (SuffixConfig, SuffixProposer, SUFFIX_DESCRIPTION),
}


def describe_model_free(proposer: NgramProposer | SuffixProposer) -> ModelDescription:
    """The proposer's description, with every setting it runs with."""
    method = "ngram" if isinstance(proposer, NgramProposer) else "suffix"
    return replace(MODEL_FREE_METHODS[method][2], settings=tuple(asdict(proposer.config).items()))


def model_free_proposer(description: ModelDescription) -> Proposer | None:
    """A new proposer of the described model-free method and settings; None for a method that runs a model.

    Raises ValueError, naming the method, for a description without settings or with
    settings of another version (the caller would otherwise run other settings than
    the ones configured).
    """
    if description.method not in MODEL_FREE_METHODS:
        return None
    config_type, build, _ = MODEL_FREE_METHODS[description.method]
    names = {f.name for f in fields(config_type)}
    given = dict(description.settings)
    if set(given) != names:
        raise ValueError(
            f"method {description.method!r} was described with settings {sorted(given)}, expected {sorted(names)}"
        )
    return build(config_type(**given))
