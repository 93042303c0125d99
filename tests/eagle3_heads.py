"""Random EAGLE-3 heads for tests: a 6-layer Llama target and heads of one or two layers over a reduced
draft vocabulary (``d2t`` / ``t2d`` a random subset of the target's), written in the ``speculators`` format, and
P-EAGLE heads built on them (``random_peagle``).
The ``pair``, ``two_layer_pair`` and ``heads`` fixtures are imported by the test modules."""
from __future__ import annotations

import pytest
import torch

from tiny_llama import build_tiny_llama
from specdec.fast.checkpoint import read_config
from specdec.heads.eagle3 import Eagle3Head, eagle3_config_for
from specdec.heads.formats import save_eagle3
from specdec.heads.peagle import PEagleHead
from specdec.types import ProposeRequest, SamplingParams

VOCAB, DRAFT_VOCAB = 32, 24  # a small vocabulary: a random head agrees with the target often enough to be accepted
PROMPTS = [[3, 7, 1, 12, 30], [5], [9, 9, 9, 2, 2, 2, 9, 9], list(range(1, 21))]  # no 0: hf_generate_greedy pads with id 0
NUM_NEW_TOKENS = 20


def greedy_drafts(proposer, prompts: dict, features: dict, seq_ids, k: int, banned: tuple[int, ...],
                  num_banned: int) -> list[list[int]]:  # fmt: skip
    """Each sequence's greedy drafts from one propose call on fresh sequences, released after; sequence ``b``
    bans ``banned`` for its first ``num_banned`` drafts (``min_tokens``)."""
    requests = [ProposeRequest(s, 0, prompts[s], k, SamplingParams(), 0, hidden_states=features[s],
                               num_banned_tokens=num_banned if s == "b" else 0, banned_token_ids=banned if s == "b" else ())
                for s in seq_ids]  # fmt: skip
    out = [p.token_ids.tolist() for p in proposer.propose(requests)]
    for s in seq_ids:
        proposer.release(s)
    return out


def random_head(target_dir, seed: int, draft_vocab: int, aux_layers=None, scale: float = 0.3,
                hidden_size: int | None = None, num_layers: int = 1) -> Eagle3Head:  # fmt: skip
    config = eagle3_config_for(read_config(target_dir), draft_vocab, aux_layers, hidden_size, num_layers=num_layers)
    torch.manual_seed(seed)
    head = Eagle3Head(config)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, scale) if p.dim() > 1 else p.fill_(1.0)
        kept = torch.randperm(config.vocab_size)[:draft_vocab].sort().values  # [draft_vocab] target ids
        head.d2t.copy_(kept - torch.arange(draft_vocab))
        head.t2d.zero_()
        head.t2d[kept] = True
    return head


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A 6-layer target (EAGLE-3's default layers 2, 3, 3) and a random head in the speculators format."""
    root = tmp_path_factory.mktemp("eagle3")
    target = build_tiny_llama(seed=0, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=6, initializer_range=0.3)
    target.save_pretrained(root / "target")
    save_eagle3(random_head(root / "target", 1, DRAFT_VOCAB), root / "head", verifier=str(root / "target"))
    return target, root / "target", root / "head"


@pytest.fixture(scope="module")
def two_layer_pair(pair, tmp_path_factory):
    """The same target and a head of two decoder layers (vLLM's ``num_hidden_layers`` 2: the second a plain Llama layer)."""
    target, target_dir, _ = pair
    head_dir = tmp_path_factory.mktemp("eagle3-two-layers") / "head"
    save_eagle3(random_head(target_dir, 5, DRAFT_VOCAB, num_layers=2), head_dir, verifier=str(target_dir))
    return target, target_dir, head_dir


@pytest.fixture(params=["one-layer", "two-layers"])
def heads(request):
    """The tests of what the head computes run with both depths."""
    return request.getfixturevalue("pair" if request.param == "one-layer" else "two_layer_pair")


def random_peagle(target_dir, seed: int, draft_vocab: int, mask_token_id: int, **head_args) -> PEagleHead:
    """``random_head``'s head as a P-EAGLE one: the mask token, and a ``mask_hidden`` drawn normal(0, 1)."""
    eagle = random_head(target_dir, seed, draft_vocab, **head_args)
    head = PEagleHead(eagle.config, mask_token_id)
    head.load_state_dict(eagle.state_dict(), strict=False)  # all but mask_hidden
    with torch.no_grad():
        head.mask_hidden.normal_(0.0, 1.0, generator=torch.Generator().manual_seed(seed))
    return head
