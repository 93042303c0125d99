"""Parallel drafting (PARD): one draft forward per step, a cache of real tokens only, q per position, refusals."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from specdec.cached_lm import ForwardCall
from specdec.methods import METHODS
from specdec.models import CachedCausalLM
from specdec.proposers import DraftModelProposer, ParallelDraftProposer, read_mask_token
from specdec.sampling import process_logits
from specdec.types import ProposeRequest, SamplingParams
from specdec_triton import speculative_config as sc
from specdec_triton.configs import DraftProposerConfig
from specdec_triton.drafters import build_proposer
from specdec_triton.plumbing import ParameterError, Parameters

MODELS = Path(__file__).resolve().parents[1] / "models"
TINY_DRAFT, TINY_PARD = MODELS / "tiny-draft", MODELS / "tiny-draft-pard"
MASK = 7  # any id: a random model was never trained on it, which changes nothing the tests check
PROMPT = [(5 * i + 11) % 256 for i in range(12)]  # [12]
SAMPLED = SamplingParams(temperature=0.9, top_k=40, top_p=0.95)


class CountingLM:
    """A CachedLM that records every forward call: the test sees what the proposer fed, and how often."""

    def __init__(self, lm):
        self.lm = lm
        self.calls: list[list[ForwardCall]] = []

    def forward(self, calls):
        self.calls.append(list(calls))
        return self.lm.forward(calls)

    def __getattr__(self, name):
        return getattr(self.lm, name)


def parallel_rows(model, tokens: list[int], k: int) -> torch.Tensor:
    """[k, vocab]: the draft's logits at the last token and at k - 1 masks after it, from a fresh forward."""
    with torch.inference_mode():
        return model(torch.tensor([tokens + [MASK] * (k - 1)])).logits[0, -k:]


def propose(proposer, seq_id, position, tokens, k, sampling=SamplingParams(), seed=0):
    (proposal,) = proposer.propose([ProposeRequest(seq_id, position, list(tokens), k, sampling, seed)])
    return proposal


def test_greedy_drafts_are_the_argmax_of_one_forward_over_the_masks(draft_model):
    lm = CountingLM(CachedCausalLM(draft_model))
    proposal = propose(ParallelDraftProposer(lm, MASK), "s", 0, PROMPT, 5)
    assert proposal.probs is None
    assert proposal.token_ids.tolist() == parallel_rows(draft_model, PROMPT, 5).argmax(-1).tolist()
    (call,) = lm.calls[0]
    assert len(lm.calls) == 1 and call.token_ids == PROMPT + [MASK] * 4 and call.num_logits == 5


def test_sampled_drafts_draw_each_position_from_its_own_q(draft_model):
    proposer = ParallelDraftProposer(CachedCausalLM(draft_model), MASK)
    proposal = propose(proposer, "s", 0, PROMPT, 4, SAMPLED, seed=3)
    q = process_logits(parallel_rows(draft_model, PROMPT, 4), SAMPLED)  # [4, vocab]
    torch.testing.assert_close(proposal.probs, q, atol=1e-5, rtol=0)
    assert bool((q[torch.arange(4), proposal.token_ids] > 0).all())
    again = ParallelDraftProposer(CachedCausalLM(draft_model), MASK)
    assert propose(again, "s", 0, PROMPT, 4, SAMPLED, seed=3).token_ids.tolist() == proposal.token_ids.tolist()


def test_the_cache_never_keeps_a_mask(draft_model):
    """Steps that accept some drafts, all, or none: every call starts within the real tokens, and each step's
    drafts are those of a fresh forward over the whole sequence (a mask left in the cache would change them)."""
    lm = CountingLM(CachedCausalLM(draft_model))
    proposer = ParallelDraftProposer(lm, MASK)
    tokens, k = list(PROMPT), 4
    drafts = propose(proposer, "s", 0, tokens, k).token_ids.tolist()
    for accepted in (2, 0, 4, 1, 3):
        new = drafts[:accepted] + [(31 * accepted + 5) % 256]  # the accepted drafts, then a recovered/bonus token
        position = len(tokens)
        tokens += new
        drafts = propose(proposer, "s", position, new, k).token_ids.tolist()
        (call,) = lm.calls[-1]
        assert call.position <= position, "a call must start within the real tokens: past them lie masks"
        assert call.token_ids == tokens[call.position :] + [MASK] * (k - 1)
        assert drafts == parallel_rows(draft_model, tokens, k).argmax(-1).tolist()
    assert len(lm.calls) == 6  # one draft forward per step, whatever k is
    proposer.release("s")
    assert proposer.num_active_sequences == 0


def test_a_batch_drafts_in_one_forward_each_sequence_its_own_k(draft_model):
    lm = CountingLM(CachedCausalLM(draft_model))
    proposer = ParallelDraftProposer(lm, MASK)
    requests = [ProposeRequest("a", 0, PROMPT, 3, SamplingParams(), 0),
                ProposeRequest("b", 0, PROMPT[:7], 1, SamplingParams(), 0),
                ProposeRequest("c", 0, PROMPT[:5], 0, SamplingParams(), 0)]  # fmt: skip
    a, b, c = proposer.propose(requests)
    assert len(lm.calls) == 1 and [call.seq_id for call in lm.calls[0]] == ["a", "b"]
    assert a.token_ids.tolist() == parallel_rows(draft_model, PROMPT, 3).argmax(-1).tolist()
    assert b.token_ids.tolist() == parallel_rows(draft_model, PROMPT[:7], 1).argmax(-1).tolist()
    assert c.token_ids.tolist() == []


def test_min_tokens_bans_eos_in_the_first_drafts_only(draft_model):
    rows = parallel_rows(draft_model, PROMPT, 3)
    banned = int(rows[0].argmax())  # the first draft's own choice: banning it must move that draft
    request = ProposeRequest("s", 0, PROMPT, 3, SamplingParams(), 0, num_banned_tokens=1, banned_token_ids=(banned,))
    (proposal,) = ParallelDraftProposer(CachedCausalLM(draft_model), MASK).propose([request])
    assert proposal.token_ids[0] != banned and proposal.token_ids[1:].tolist() == rows[1:].argmax(-1).tolist()


def test_a_mask_outside_the_vocabulary_is_refused(draft_model):
    with pytest.raises(ValueError, match=r"pard_token 256 is outside the draft's vocabulary \[0, 256\)"):
        ParallelDraftProposer(CachedCausalLM(draft_model), 256)


def test_a_checkpoint_without_a_mask_token_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=rf"draft model '{re.escape(str(TINY_DRAFT))}' names no mask token "
                                         r"\('pard_token' in its config.json\)"):  # fmt: skip
        read_mask_token(TINY_DRAFT)
    config = DraftProposerConfig("draft_model", str(TINY_DRAFT), None, None, "float32", "fast", 1,
                                 parallel_drafting=True)  # fmt: skip
    with pytest.raises(ValueError, match="names no mask token"):
        build_proposer(config, "cpu")


@pytest.mark.skipif(not TINY_PARD.is_dir(), reason="models/tiny-draft-pard not trained")
@pytest.mark.parametrize("parallel", [True, False])
def test_the_shipped_pard_draft_loads_as_either_drafter(parallel):
    config = DraftProposerConfig("draft_model", str(TINY_PARD), None, None, "float32", "fast", 1,
                                 parallel_drafting=parallel)  # fmt: skip
    loaded = build_proposer(config, "cpu")
    assert type(loaded.proposer) is (ParallelDraftProposer if parallel else DraftModelProposer)
    assert loaded.description.method == "draft_model"
    if parallel:
        assert loaded.proposer.mask_token_id == read_mask_token(TINY_PARD)


def draft_parameters(method: str, parallel: str, draft: Path = TINY_DRAFT) -> Parameters:
    return Parameters({"method": method, "draft_model": str(draft), "parallel_drafting": parallel,
                       "target_model": str(MODELS / "tiny-target")}, component="draft_proposer")  # fmt: skip


def test_parallel_drafting_is_read_from_config_pbtxt():
    assert DraftProposerConfig.from_parameters(draft_parameters("draft_model", "true")).parallel_drafting
    assert not DraftProposerConfig.from_parameters(draft_parameters("draft_model", "")).parallel_drafting
    assert [m.name for m in METHODS.values() if m.parallel_drafting] == ["draft_model", "eagle3"]  # eagle3: P-EAGLE


@pytest.mark.parametrize("method", ["mlp_speculator", "medusa", "mtp", "dflash", "ngram", "suffix"])
def test_methods_that_cannot_draft_in_parallel_are_refused_by_name(method):
    with pytest.raises(ParameterError, match=rf"draft_proposer: parameter 'parallel_drafting' true is for methods "
                                             rf"\['draft_model', 'eagle3'\], not '{method}'$"):  # fmt: skip
        DraftProposerConfig.from_parameters(draft_parameters(method, "true"))
    DraftProposerConfig.from_parameters(draft_parameters(method, "false"))  # false is every method's default


def test_vllms_key_sets_the_draft_proposers():
    settings = sc.parse('{"method": "draft_model", "model": "/ckpt/pard", "num_speculative_tokens": 6, '
                        '"parallel_drafting": true}')  # fmt: skip
    assert settings["draft_proposer"] == {"method": "draft_model", "draft_model": "/ckpt/pard",
                                          "parallel_drafting": "true"}  # fmt: skip
    with pytest.raises(sc.SpeculativeConfigError, match=r"'parallel_drafting' must be true or false, got 1"):
        sc.parse('{"method": "draft_model", "parallel_drafting": 1}')
    with pytest.raises(sc.SpeculativeConfigError, match=r"key 'parallel_drafting' true is for methods "
                                                         r"\['draft_model', 'eagle3'\], not 'medusa'"):  # fmt: skip
        sc.parse('{"method": "medusa", "model": "/ckpt/head", "parallel_drafting": true}')  # before serve.sh starts
    assert sc.parse('{"model": "/ckpt/pard", "parallel_drafting": true}')["draft_proposer"]["parallel_drafting"] == "true"
