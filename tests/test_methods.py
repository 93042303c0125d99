"""The methods' one declaration (specdec.methods) is what every reader of a method's kind sees."""
from __future__ import annotations

import pytest

from specdec.heads import HEAD_METHODS
from specdec.methods import HEAD, METHODS, MODEL, MODEL_FREE, Method, names_of
from specdec.proposers import PROPOSERS
from specdec.proposers.model_free import MODEL_FREE_METHODS
from specdec_triton import speculative_config


def test_every_reader_of_a_methods_kind_agrees_with_the_declaration():
    assert tuple(PROPOSERS) == tuple(METHODS)  # one proposer class per declared method
    assert tuple(speculative_config.METHODS) == tuple(METHODS)  # kept torch-free for serve.sh's check
    assert HEAD_METHODS == names_of(HEAD) == ("eagle3", "mlp_speculator", "medusa", "mtp", "dflash")
    in_target = tuple(name for name, method in METHODS.items() if method.in_target_checkpoint)
    assert speculative_config.TARGET_CHECKPOINT_METHODS == in_target == ("mtp",)
    assert tuple(MODEL_FREE_METHODS) == names_of(MODEL_FREE) == ("ngram", "suffix")
    assert names_of(MODEL) == ("draft_model",)
    parallel = tuple(name for name, method in METHODS.items() if method.parallel_drafting)
    assert speculative_config.PARALLEL_DRAFTING_METHODS == parallel == ("draft_model", "eagle3")


def test_a_method_of_an_unknown_kind_is_refused_naming_it():
    with pytest.raises(ValueError, match="method 'mtp': kind must be one of"):
        Method("mtp", "heads")
