"""Greedy speculative decoding must reproduce the target's own greedy decoding token for token.

Reference: ``model.generate(do_sample=False)``. A mismatch is tolerated only at a
position where the target's top-two logits are within ``TIE_TOLERANCE`` (both
orders are then correct up to float rounding); the test checks that it is so.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
from specdec.models import CachedCausalLM, load_causal_lm
from specdec.engine import GenerationParams
from specdec.generate import generate
from specdec.heads import build_head_proposer
from specdec.proposers import DraftModelProposer, NgramProposer, ParallelDraftProposer, SuffixProposer, read_mask_token
from specdec.rejection_sampler import RejectionSampler
from specdec.types import RequestStats
from specdec.verifier import TargetVerifier

SHIPPED_TARGET = Path(__file__).resolve().parents[1] / "models" / "tiny-target"  # it carries an MTP layer
TIE_TOLERANCE = 1e-4
SHIPPED_PARD = Path(__file__).resolve().parents[1] / "models" / "tiny-draft-pard"
SHIPPED_PEAGLE = Path(__file__).resolve().parents[1] / "models" / "tiny-peagle"
NUM_NEW_TOKENS = 24
KS = (1, 3, 5)

PROMPTS = [
    "a",
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in a land far, far away, there lived a",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return",
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    "SELECT name, COUNT(*) FROM users GROUP BY name ORDER BY",
    '{"id": 1, "name": "alpha", "tags": ["x", "y"], "value":',
    "import torch\nimport numpy as np\n\nx = torch.randn(4, 4)\ny = x @ x.T\nprint(",
    "Grüße aus München! Ça va très bien, merci.",
    "東京は日本の首都です。大阪は",
    "Привет, мир! Как дела?",
    "emoji: 🚀🔥✨ and more 🚀🔥",
    "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "abababababababababab",
    "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer",
    "<html><body><div class=\"main\"><p>Hello</p></div></body>",
    "The mitochondria is the powerhouse of the cell. " * 3,
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n"
    "    def push(self, x):\n        self.items.append(x)\n\n"
    "    def pop(self):\n        return self.items.pop()\n\n    def peek(self):\n",
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore et dolore "
    "magna aliqua. Ut enim ad minim veniam, quis nostrud exercitation ullamco laboris nisi ut aliquip ex ea commodo "
    "consequat. Duis aute irure dolor in reprehenderit in voluptate velit esse cillum dolore eu fugiat nulla pariatur.",
    "x",
    "\n\n\t  ",
]


def text_to_ids(text: str, vocab_size: int) -> list[int]:
    """A stand-in tokenizer for random models: UTF-8 bytes modulo the vocabulary."""
    return [b % vocab_size for b in text.encode("utf-8")]


def assert_equal_up_to_ties(model, prompt_ids: list[int], ours: list[int], reference: list[int]) -> None:
    for j, (a, b) in enumerate(zip(ours, reference)):
        if a != b:
            with torch.inference_mode():
                logits = model(torch.tensor([prompt_ids + reference[:j]])).logits[0, -1].float()  # [vocab]
            top = torch.topk(logits, 2)
            gap = float(top.values[0] - top.values[1])
            assert gap < TIE_TOLERANCE and {a, b} == set(top.indices.tolist()), (
                f"token {j}: speculative {a} != reference {b}, top-two gap {gap:.3g}\n"
                f"ours={ours}\nreference={reference}"
            )
            return
    assert len(ours) == len(reference), f"ours={ours}\nreference={reference}"


def run_engine(proposer, target, prompt_ids, k, max_tokens, eos_token_ids=()) -> tuple[list[int], RequestStats]:
    verifier = TargetVerifier(CachedCausalLM(target))
    params = GenerationParams(max_tokens=max_tokens, num_speculative_tokens=k, eos_token_ids=eos_token_ids)
    out: list[int] = []
    for step in generate(proposer, verifier, RejectionSampler(), prompt_ids, params):
        out += step.new_token_ids
    return out, step.stats


def make_proposer(method: str, target, draft):
    if method == "draft_random":
        return DraftModelProposer(CachedCausalLM(draft))
    if method == "draft_equal":
        return DraftModelProposer(CachedCausalLM(target))
    if method == "draft_parallel":  # PARD's one forward over masks; a random draft was never taught the mask
        return ParallelDraftProposer(CachedCausalLM(draft), mask_token_id=7)
    if method == "suffix":  # one proposer for all prompts: each response joins its global tree
        return SuffixProposer()
    return NgramProposer(prompt_lookup_min=1, prompt_lookup_max=4)


@pytest.fixture(scope="module")
def random_references(target_model, hf_greedy):
    vocab = target_model.config.vocab_size
    return [hf_greedy(target_model, text_to_ids(p, vocab), NUM_NEW_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("method", ["draft_random", "draft_equal", "draft_parallel", "ngram", "suffix"])
def test_random_models_match_target_greedy(method, k, target_model, draft_model, random_references):
    proposer = make_proposer(method, target_model, draft_model)
    vocab = target_model.config.vocab_size
    drafted = accepted = 0
    for prompt, reference in zip(PROMPTS, random_references):
        prompt_ids = text_to_ids(prompt, vocab)
        ours, stats = run_engine(proposer, target_model, prompt_ids, k, NUM_NEW_TOKENS)
        assert_equal_up_to_ties(target_model, prompt_ids, ours, reference)
        drafted += stats.num_draft_tokens
        accepted += stats.num_accepted_tokens
    # Both the accept and the reject paths were exercised where the method allows it.
    assert drafted > 0
    if method == "draft_equal":
        assert accepted / drafted > 0.95
    else:
        assert 0 < accepted < drafted


@pytest.mark.parametrize("k", KS)
@pytest.mark.parametrize("method", ["draft_model", "draft_model+parallel", "ngram", "suffix", "mtp", "eagle3+parallel"])
def test_shipped_pair_matches_target_greedy(method, k, shipped_pair, hf_greedy):
    tokenizer, target = shipped_pair.tokenizer, shipped_pair.target
    eos = tokenizer.eos_token_id
    assert eos is not None, "the shipped tokenizer must define an EOS token"
    if method == "draft_model":
        proposer = DraftModelProposer(CachedCausalLM(shipped_pair.draft))
    elif method == "draft_model+parallel":
        if not SHIPPED_PARD.is_dir():
            pytest.skip(f"{SHIPPED_PARD} not trained (scripts/train_pard_draft.py)")
        pard = load_causal_lm(SHIPPED_PARD, dtype="float32")
        proposer = ParallelDraftProposer(CachedCausalLM(pard), read_mask_token(SHIPPED_PARD))
    elif method == "suffix":
        proposer = SuffixProposer()
    elif method == "mtp":  # the shipped target's own MTP layer, chained k times
        proposer = build_head_proposer("mtp", SHIPPED_TARGET, SHIPPED_TARGET, max_num_seqs=1)
    elif method == "eagle3+parallel":  # the shipped P-EAGLE head: every draft of a step from one head pass
        if not SHIPPED_PEAGLE.is_dir():
            pytest.skip(f"{SHIPPED_PEAGLE} not trained (scripts/train_draft_head.py --parallel-drafting)")
        proposer = build_head_proposer("eagle3", SHIPPED_PEAGLE, SHIPPED_TARGET, max_num_seqs=1, parallel_drafting=True)
    else:
        proposer = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=4)
    accepted = 0
    for prompt in PROMPTS:
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        reference = hf_greedy(target, prompt_ids, 2 * NUM_NEW_TOKENS, eos_token_id=eos)
        ours, stats = run_engine(proposer, target, prompt_ids, k, 2 * NUM_NEW_TOKENS, eos_token_ids=(eos,))
        assert_equal_up_to_ties(target, prompt_ids, ours, reference)
        accepted += stats.num_accepted_tokens
    assert accepted > 0
