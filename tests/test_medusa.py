"""Medusa heads: vLLM's layout, the proposer's chain and tree over the target's last hidden state, losslessness."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tiny_llama import build_tiny_llama, hf_generate_greedy
from specdec.engine import GenerationParams
from specdec.generate import generate
from specdec.fast.runner import FastCausalLM
from specdec.heads import build_head_proposer
from specdec.heads.medusa import Medusa, MedusaConfig, load_medusa, save_medusa
from specdec.models import CachedCausalLM
from specdec.rejection_sampler import RejectionSampler
from specdec.tree import ROOT, parse_token_tree
from specdec.types import ProposeRequest, SamplingParams
from specdec.verifier import TargetVerifier
from test_sampled_losslessness import (
    NUM_SAMPLES, CountingSampler, chisquare_pvalue, exact_joint, sample_first_tokens,
)  # fmt: skip

VOCAB, HIDDEN, NUM_HEADS = 12, 32, 3  # a small vocabulary: random heads are sometimes right
PROMPTS = [[3, 7, 1, 11, 10], [5], [9, 9, 9, 2, 2, 2, 9, 9], [i % 11 + 1 for i in range(20)]]
TREE = parse_token_tree("[(0,), (1,), (2,), (0, 0), (0, 1), (1, 0), (0, 0, 0), (0, 1, 0)]")


def write_medusa(out, vocab: int = VOCAB, hidden: int = HIDDEN, num_heads: int = NUM_HEADS, seed: int = 1,
                 **options) -> Medusa:  # fmt: skip
    torch.manual_seed(seed)
    model = Medusa(MedusaConfig(num_heads, 1, hidden, vocab, options.pop("truncated_vocab_size", vocab), **options))
    with torch.no_grad():
        for p in model.parameters():  # random blocks and biases, so that every weight shows in the logits
            p.copy_(torch.randn_like(p) * 0.5)
    save_medusa(model, out)
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("medusa")
    target = build_tiny_llama(seed=0, vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, initializer_range=0.3)
    target.save_pretrained(root / "target")
    write_medusa(root / "head")
    return target, root / "target", root / "head"


@pytest.mark.parametrize("options", [{}, {"shared_lm_head": True, "bias": False}, {"logit_scale": 0.5}])
def test_vllms_layout_round_trips(tmp_path, pair, options):
    _, target_dir, _ = pair
    model = write_medusa(tmp_path / "head", **options)
    raw = json.loads((tmp_path / "head" / "config.json").read_text())
    assert raw["model_type"] == "medusa" and raw["num_heads"] == NUM_HEADS and raw["num_hidden_layers"] == 1
    names = set(load_file(tmp_path / "head" / "model.safetensors"))
    assert "blocks.2.layers.0.weight" in names and ("blocks.2.layers.0.bias" in names) is model.config.bias
    assert {n for n in names if n.startswith("lm_heads.")} == (
        {"lm_heads.0.weight"} if model.config.shared_lm_head else {f"lm_heads.{i}.weight" for i in range(NUM_HEADS)})
    loaded = load_medusa(tmp_path / "head", target_dir, torch.float32, "cpu")
    assert loaded.config == model.config
    hidden = torch.randn(4, HIDDEN)
    torch.testing.assert_close(loaded(hidden), model(hidden))
    assert loaded(hidden).shape == (NUM_HEADS, 4, VOCAB) and loaded(hidden, 2).shape == (2, 4, VOCAB)


def test_the_original_releases_names_and_a_token_map_load(tmp_path, pair):
    """``medusa_num_heads`` / ``medusa_num_layers``, names under ``medusa_heads.``, biases without
    ``medusa_fc_bias``; a ``token_map`` keeps the LM heads' mapped rows and never drafts another id."""
    _, target_dir, _ = pair
    model = write_medusa(tmp_path / "head")
    weights = load_file(tmp_path / "head" / "model.safetensors")
    kept = torch.tensor([0, 2, 3, 5, 7, 8, 10, 11])
    save_file({**{f"medusa_heads.{n}": t for n, t in weights.items()}, "token_map": kept},
              tmp_path / "head" / "model.safetensors")  # fmt: skip
    (tmp_path / "head" / "config.json").write_text(json.dumps({
        "medusa_num_heads": NUM_HEADS, "medusa_num_layers": 1, "hidden_size": HIDDEN, "vocab_size": VOCAB,
        "truncated_vocab_size": len(kept)}))  # fmt: skip
    loaded = load_medusa(tmp_path / "head", target_dir, torch.float32, "cpu")
    assert loaded.config.bias and loaded.num_heads == NUM_HEADS and loaded.config.truncated_vocab_size == len(kept)
    hidden = torch.randn(5, HIDDEN)
    want, got = model(hidden), loaded(hidden)
    torch.testing.assert_close(got[..., kept], want[..., kept])
    dropped = torch.ones(VOCAB, dtype=torch.bool)
    dropped[kept] = False
    assert torch.isneginf(got[..., dropped]).all()


@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_greedy_chain_equals_hf_generate_for_every_k_up_to_num_heads(pair, engine):
    target, target_dir, head_dir = pair
    lm = FastCausalLM(target_dir, max_num_seqs=4) if engine == "fast" else CachedCausalLM(target)
    verifier, proposer = TargetVerifier(lm), build_head_proposer("medusa", head_dir, target_dir)
    assert proposer.hidden_state_layers == (2,)  # the final normed state of a 2-layer target
    accepted = 0
    for k in range(1, NUM_HEADS + 1):
        for prompt in PROMPTS:
            out, stats = [], None
            for step in generate(proposer, verifier, RejectionSampler(), prompt,
                                 GenerationParams(max_tokens=20, num_speculative_tokens=k)):  # fmt: skip
                out += step.new_token_ids
                stats = step.stats or stats
            assert out == hf_generate_greedy(target, prompt, 20), (k, prompt)
            accepted += stats.num_accepted_tokens
    assert accepted > 0
    assert verifier.num_active_sequences == 0 and proposer.num_active_sequences == 0


def test_greedy_tree_equals_hf_generate_and_accepts_more_than_the_chain(pair):
    target, target_dir, head_dir = pair
    verifier = TargetVerifier(FastCausalLM(target_dir, max_num_seqs=4))
    accepted = {}
    for name, tree in (("chain", None), ("tree", TREE)):
        proposer = build_head_proposer("medusa", head_dir, target_dir, tree=tree)
        accepted[name] = 0
        for k in (3, 5, TREE.num_nodes):  # the tree cut to k nodes; the chain of k = 3 heads
            for prompt in PROMPTS:
                params = GenerationParams(max_tokens=20, num_speculative_tokens=min(k, 3) if tree is None else k)
                out = []
                for step in generate(proposer, verifier, RejectionSampler(), prompt, params):
                    out += step.new_token_ids
                assert out == hf_generate_greedy(target, prompt, 20), (name, k, prompt)
                accepted[name] += step.stats.num_accepted_tokens
        assert proposer.num_active_sequences == 0
    assert accepted["tree"] > accepted["chain"] > 0, accepted


def test_a_tree_node_takes_its_depths_head_at_its_rank(pair):
    """Medusa's Cartesian tree: the node at path (r1..rd) is head d-1's rd-th most probable token, whatever its parent."""
    _, target_dir, head_dir = pair
    proposer = build_head_proposer("medusa", head_dir, target_dir, tree=TREE)
    hidden = torch.randn(3, HIDDEN)
    requests = [ProposeRequest("a", 0, [1, 2, 3, 4], TREE.num_nodes, SamplingParams(), 0, hidden_states=hidden),
                ProposeRequest("b", 0, [5, 6, 7, 8], 4, SamplingParams(temperature=0.7), 1, hidden_states=hidden,
                               num_banned_tokens=1, banned_token_ids=(0,))]  # fmt: skip
    a, b = proposer.propose(requests)
    ranked = proposer.model(hidden[-1]).topk(3, dim=-1).indices.tolist()  # [heads][ranks]
    assert a.parents == TREE.parents and b.parents == TREE.first(4).parents == (ROOT, ROOT, 0, 2)  # chain 3, then (1,)
    assert a.token_ids.tolist() == [ranked[len(p) - 1][p[-1]] for p in TREE.paths] and a.probs is None
    first = [t for t in proposer.model(hidden[-1])[0].argsort(descending=True).tolist() if t != 0]  # 0 banned
    assert b.token_ids.tolist() == [*first[:2], ranked[1][0], ranked[2][0]]
    assert proposer.num_active_sequences == 2


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9, top_k=8, seed=5)])
def test_seeded_output_with_a_tree_equals_k0s(pair, sampling):
    """The tree's verification draws as k = 0 does: a seeded request emits k = 0's tokens exactly."""
    _, target_dir, head_dir = pair
    verifier = TargetVerifier(FastCausalLM(target_dir, max_num_seqs=2))
    proposer = build_head_proposer("medusa", head_dir, target_dir, tree=TREE)
    sampler, accepted = RejectionSampler(), 0
    for prompt in PROMPTS:
        plain = GenerationParams(max_tokens=24, sampling=sampling)
        reference = [t for out in generate(None, verifier, sampler, prompt, plain) for t in out.new_token_ids]
        params = GenerationParams(max_tokens=24, sampling=sampling, num_speculative_tokens=TREE.num_nodes)
        steps = list(generate(proposer, verifier, sampler, prompt, params))
        assert [t for out in steps for t in out.new_token_ids] == reference, prompt
        accepted += steps[-1].stats.num_accepted_tokens
    assert accepted > 0


@pytest.mark.slow
def test_speculative_sampling_with_a_chain_of_heads_matches_the_target_distribution(tmp_path):
    target = build_tiny_llama(seed=0, vocab_size=16, hidden_size=16, num_hidden_layers=1, initializer_range=0.3)
    target.save_pretrained(tmp_path / "target")
    write_medusa(tmp_path / "head", vocab=16, hidden=16, num_heads=4, seed=3)
    proposer = build_head_proposer("medusa", tmp_path / "head", tmp_path / "target")
    sampler = CountingSampler(RejectionSampler("probabilistic"))
    counts = sample_first_tokens(target, None, sampler, NUM_SAMPLES, proposer=proposer)  # 4 drafts a step, sampled
    assert sampler.accepted > 200 and sampler.drafted - sampler.accepted > 200, (sampler.accepted, sampler.drafted)
    assert chisquare_pvalue(counts, exact_joint(target)) > 1e-3


def test_more_drafts_or_depth_than_heads_and_another_target_are_refused_by_name(pair, tmp_path):
    _, target_dir, head_dir = pair
    proposer = build_head_proposer("medusa", head_dir, target_dir)
    request = ProposeRequest("s", 0, [1, 2], NUM_HEADS + 1, SamplingParams(), 0, hidden_states=torch.zeros(1, HIDDEN))
    with pytest.raises(ValueError, match=rf"{NUM_HEADS + 1} drafts asked of a Medusa head with num_heads=3"):
        proposer.propose([request])
    with pytest.raises(ValueError, match=r"after 2 tokens needs the target's hidden state at position 0, the proposer "
                                         r"has it at -1"):  # fmt: skip
        proposer.propose([ProposeRequest("s", 0, [1, 2], 2, SamplingParams(), 0)])
    with pytest.raises(ValueError, match=r"speculative_token_tree is 4 deep, but the Medusa head has num_heads=3"):
        build_head_proposer("medusa", head_dir, target_dir, tree=parse_token_tree("[(0,), (0, 0), (0, 0, 0), (0, 0, 0, 0)]"))
    other = tmp_path / "other"
    build_tiny_llama(seed=2, vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2).save_pretrained(other)
    with pytest.raises(ValueError, match=rf"Medusa head '{head_dir}' \(hidden_size 32, vocab_size 12\) does not fit "
                                         rf"target '{other}' \(hidden size 48"):  # fmt: skip
        build_head_proposer("medusa", head_dir, other)
    with pytest.raises(ValueError, match=r"is a medusa checkpoint, not mlp_speculator"):
        build_head_proposer("mlp_speculator", head_dir, target_dir)


def test_a_bad_checkpoint_is_refused_naming_what_is_wrong(pair, tmp_path):
    _, target_dir, _ = pair
    write_medusa(tmp_path / "head")
    weights = load_file(tmp_path / "head" / "model.safetensors")
    save_file({n: t for n, t in weights.items() if n != "lm_heads.2.weight"}, tmp_path / "head" / "model.safetensors")
    with pytest.raises(ValueError, match=r"3 heads of 1 blocks\): missing \['lm_heads.2.weight'\]"):
        load_medusa(tmp_path / "head", target_dir, torch.float32, "cpu")
    save_file({**weights, "blocks.0.layers.0.weight": weights["blocks.0.layers.0.weight"][:, :-1].contiguous()},
              tmp_path / "head" / "model.safetensors")  # fmt: skip
    with pytest.raises(ValueError, match=r"wrong shape \[\('blocks.0.layers.0.weight', \(32, 31\), \(32, 32\)\)\]"):
        load_medusa(tmp_path / "head", target_dir, torch.float32, "cpu")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    (tmp_path / "head" / "config.json").write_text(json.dumps({**config, "truncated_vocab_size": 8}))
    save_file(weights, tmp_path / "head" / "model.safetensors")
    with pytest.raises(ValueError, match=r"truncated_vocab_size 8 < vocab_size 12 needs a token_map tensor"):
        load_medusa(tmp_path / "head", target_dir, torch.float32, "cpu")
    (tmp_path / "head" / "config.json").write_text(json.dumps({"model_type": "medusa", "hidden_size": HIDDEN}))
    with pytest.raises(ValueError, match=r"config.json lacks \['num_heads', 'vocab_size'\]"):
        build_head_proposer("medusa", tmp_path / "head", target_dir)
