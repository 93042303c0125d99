"""DFlash: z-lab's checkpoint layout, the block proposer's greedy and sampled drafts, its context cache, refusals."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from tiny_llama import build_tiny_llama, hf_generate_greedy
from specdec.engine import GenerationParams
from specdec.fast.checkpoint import read_config
from specdec.fast.runner import FastCausalLM
from specdec.generate import generate
from specdec.heads import build_head_proposer
from specdec.heads.dflash import DFlashDrafter, dflash_config_for, load_dflash, save_dflash
from specdec.models import CachedCausalLM
from specdec.rejection_sampler import RejectionSampler
from specdec.tree import parse_token_tree
from specdec.types import ProposeRequest, SamplingParams
from specdec.verifier import TargetVerifier
from test_sampled_losslessness import NUM_SAMPLES, CountingSampler, chisquare_pvalue, exact_joint, sample_first_tokens

VOCAB, HIDDEN, BLOCK = 12, 32, 5  # a small vocabulary: a random drafter is sometimes right
PROMPTS = [[3, 7, 1, 11, 10], [5], [9, 9, 9, 2, 2, 2, 9, 9], [i % 11 + 1 for i in range(20)]]


def write_dflash(out, target_dir, block_size: int = BLOCK, num_layers: int = 2, seed: int = 1, mask: int = 11,
                 layer_ids=(0, 1), dtype=None) -> DFlashDrafter:  # fmt: skip
    """A random drafter for the target at ``target_dir``, written in z-lab's layout."""
    torch.manual_seed(seed)
    config = dflash_config_for(read_config(target_dir), block_size, mask, num_layers, layer_ids)
    model = load_dflash_like(config, target_dir)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not name.startswith("target_"):
                p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 1.0) + (1.0 if p.dim() == 1 else 0.0))
    save_dflash(model, out, dtype)
    return model


def load_dflash_like(config, target_dir) -> DFlashDrafter:
    from specdec.heads.dflash import target_embedding_and_head

    model = DFlashDrafter(config)
    embedding, head = target_embedding_and_head(target_dir)
    model.target_embed_tokens.weight.data.copy_(embedding)
    model.target_lm_head.weight.data.copy_(head)
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("dflash")
    target = build_tiny_llama(seed=0, vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, initializer_range=0.3)
    target.save_pretrained(root / "target")
    write_dflash(root / "head", root / "target")
    return target, root / "target", root / "head"


def test_the_reference_layout_loads_and_round_trips(pair, tmp_path):
    _, target_dir, head_dir = pair
    raw = json.loads((head_dir / "config.json").read_text())
    assert raw["architectures"] == ["DFlashDraftModel"] and raw["model_type"] == "qwen3"
    assert raw["dflash_config"]["block_size"] == BLOCK and raw["dflash_config"]["mask_token_id"] == 11
    assert raw["dflash_config"]["target_layer_ids"] == [0, 1] and raw["num_target_layers"] == 2
    names = set(load_file(head_dir / "model.safetensors"))
    assert {"fc.weight", "hidden_norm.weight", "norm.weight", "layers.1.self_attn.q_norm.weight",
            "layers.1.self_attn.k_norm.weight", "layers.0.self_attn.o_proj.weight", "layers.0.mlp.gate_proj.weight",
            "layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight"} <= names  # fmt: skip
    assert not any("embed" in n or "lm_head" in n for n in names)  # the target's, shared
    model = load_dflash(head_dir, target_dir, torch.float32, "cpu")
    assert model.config.hidden_state_layers == (1, 2)  # layer outputs 0 and 1: transformers' hidden_states[1], [2]
    assert model.fc.weight.shape == (HIDDEN, 2 * HIDDEN)
    torch.testing.assert_close(model.own_state_dict()["fc.weight"], load_file(head_dir / "model.safetensors")["fc.weight"])
    # the first release's top-level keys; no target_layer_ids: the reference's default (one layer: the middle)
    write_dflash(tmp_path / "old", target_dir, num_layers=1, layer_ids=(1,))
    raw = json.loads((tmp_path / "old" / "config.json").read_text())
    raw["block_size"], raw["mask_token_id"] = raw["dflash_config"].pop("block_size"), raw["dflash_config"].pop("mask_token_id")
    del raw["dflash_config"]["target_layer_ids"]
    (tmp_path / "old" / "config.json").write_text(json.dumps(raw))
    old = load_dflash(tmp_path / "old", target_dir, torch.float32, "cpu")
    assert (old.config.block_size, old.config.mask_token_id, old.config.target_layer_ids) == (BLOCK, 11, (1,))


@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_greedy_drafts_equal_hf_generate_for_every_k_up_to_the_block(pair, engine):
    target, target_dir, head_dir = pair
    lm = FastCausalLM(target_dir, max_num_seqs=4) if engine == "fast" else CachedCausalLM(target)
    verifier, proposer = TargetVerifier(lm), build_head_proposer("dflash", head_dir, target_dir)
    assert proposer.hidden_state_layers == (1, 2)
    accepted = 0
    for k in range(1, BLOCK):
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


def test_one_forward_drafts_each_block_positions_argmax(pair):
    """Draft j is the argmax of block position j of one pass over [last token, masks], attending to the
    context made from the target's features at positions 0 .. N - 2 (checked against a direct forward)."""
    _, target_dir, head_dir = pair
    proposer = build_head_proposer("dflash", head_dir, target_dir)
    model = proposer.model
    features = torch.randn(3, 2 * HIDDEN)
    (proposal,) = proposer.propose([ProposeRequest("a", 0, [1, 2, 3, 4], BLOCK - 1, SamplingParams(), 0,
                                                   hidden_states=features)])  # fmt: skip
    context = model.context(features)  # [3, h]
    kv = model.context_keys_values(context, torch.arange(3))
    block = torch.tensor([[4] + [11] * (BLOCK - 1)])
    mask = torch.ones(1, 1, BLOCK, 3 + BLOCK, dtype=torch.bool)
    hidden = model(block, torch.arange(3, 3 + BLOCK)[None], [(k.transpose(0, 1)[None], v.transpose(0, 1)[None])
                                                             for k, v in kv], mask)  # fmt: skip
    assert proposal.token_ids.tolist() == model.logits(hidden[0, 1:]).argmax(-1).tolist() and proposal.probs is None


def test_rolled_back_context_is_forgotten(pair):
    """A request that cuts the sequence back replaces the context from its hidden_position: its drafts are a
    fresh proposer's for the same sequence, and the cache holds only the verified positions."""
    _, target_dir, head_dir = pair
    proposer = build_head_proposer("dflash", head_dir, target_dir)
    fresh = build_head_proposer("dflash", head_dir, target_dir)
    first, second = torch.randn(6, 2 * HIDDEN), torch.randn(3, 2 * HIDDEN)
    greedy = SamplingParams()
    proposer.propose([ProposeRequest("s", 0, [1, 2, 3, 4, 5, 6, 7], 3, greedy, 0, hidden_states=first)])
    assert proposer.context_length("s") == 6
    # three drafts rejected and two tokens rolled back: positions 4 .. 6 replaced, 3 rows of new features
    (cut,) = proposer.propose([ProposeRequest("s", 4, [8, 9, 10], 3, greedy, 0, hidden_position=3,
                                              hidden_states=second)])  # fmt: skip
    assert proposer.context_length("s") == 6
    rows = torch.cat([first[:3], second])
    (want,) = fresh.propose([ProposeRequest("t", 0, [1, 2, 3, 4, 8, 9, 10], 3, greedy, 0, hidden_states=rows)])
    assert cut.token_ids.tolist() == want.token_ids.tolist()
    # cut back without new features: the context shrinks to the positions still verified
    proposer.propose([ProposeRequest("s", 2, [5], 0, greedy, 0)])
    assert proposer.context_length("s") == 2
    with pytest.raises(ValueError, match=r"4 tokens need the target's hidden states at 3 positions, the proposer "
                                         r"has 2"):  # fmt: skip
        proposer.propose([ProposeRequest("s", 3, [6], 1, greedy, 0)])
    proposer.release("s")
    assert proposer.num_active_sequences == 0 and proposer.cache.num_active == 0


def test_sampled_drafts_are_drawn_from_each_positions_q(pair):
    _, target_dir, head_dir = pair
    proposer = build_head_proposer("dflash", head_dir, target_dir)
    sampling = SamplingParams(temperature=0.8, top_k=6)
    request = ProposeRequest("s", 0, [1, 2, 3], BLOCK - 1, sampling, 7, hidden_states=torch.randn(2, 2 * HIDDEN),
                             num_banned_tokens=2, banned_token_ids=(0, 1))  # fmt: skip
    (proposal,) = proposer.propose([request])
    q = proposal.probs  # [k, vocab]
    assert q.shape == (BLOCK - 1, VOCAB) and torch.allclose(q.sum(-1), torch.ones(BLOCK - 1))
    assert (q > 0).sum(-1).max() <= 6 and (q[:2, :2] == 0).all()  # top-k 6; ids 0 and 1 banned in the first two
    assert all(q[j, t] > 0 for j, t in enumerate(proposal.token_ids.tolist()))
    (again,) = build_head_proposer("dflash", head_dir, target_dir).propose([request])
    assert again.token_ids.tolist() == proposal.token_ids.tolist()  # seeded


@pytest.mark.slow
def test_speculative_sampling_with_dflash_drafts_matches_the_target_distribution(tmp_path):
    target = build_tiny_llama(seed=0, vocab_size=16, hidden_size=16, num_hidden_layers=1, initializer_range=0.3)
    target.save_pretrained(tmp_path / "target")
    write_dflash(tmp_path / "head", tmp_path / "target", block_size=5, num_layers=1, seed=3, mask=15, layer_ids=(0,))
    proposer = build_head_proposer("dflash", tmp_path / "head", tmp_path / "target")
    sampler = CountingSampler(RejectionSampler("probabilistic"))
    counts = sample_first_tokens(target, None, sampler, NUM_SAMPLES, proposer=proposer)  # 4 drafts a step, sampled
    assert sampler.accepted > 200 and sampler.drafted - sampler.accepted > 200, (sampler.accepted, sampler.drafted)
    assert chisquare_pvalue(counts, exact_joint(target)) > 1e-3


def test_more_drafts_than_the_block_a_tree_and_another_target_are_refused_by_name(pair, tmp_path):
    _, target_dir, head_dir = pair
    proposer = build_head_proposer("dflash", head_dir, target_dir)
    request = ProposeRequest("s", 0, [1, 2], BLOCK, SamplingParams(), 0, hidden_states=torch.zeros(1, 2 * HIDDEN))
    with pytest.raises(ValueError, match=rf"{BLOCK} drafts asked of a DFlash drafter with block_size={BLOCK}; "
                                         rf"num_speculative_tokens must be at most block_size - 1 = {BLOCK - 1}"):  # fmt: skip
        proposer.propose([request])
    assert proposer.num_active_sequences == 0  # refused before any state moved
    with pytest.raises(ValueError, match=r"speculative_token_tree: method 'dflash' drafts a chain only"):
        build_head_proposer("dflash", head_dir, target_dir, tree=parse_token_tree("[(0,), (1,)]"))
    other = tmp_path / "other"
    build_tiny_llama(seed=2, vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2).save_pretrained(other)
    with pytest.raises(ValueError, match=rf"DFlash drafter '{head_dir}' \(hidden_size 32, vocab_size 12\) does not "
                                         rf"fit target '{other}' \(hidden size 48"):  # fmt: skip
        build_head_proposer("dflash", head_dir, other)
    with pytest.raises(ValueError, match=r"is a dflash checkpoint, not eagle3"):
        build_head_proposer("eagle3", head_dir, target_dir)


@pytest.mark.parametrize("edit, message", [
    (lambda raw: raw.update(architectures=["DFlash2DraftModel"]), r"is a DFlash2DraftModel: its candidate selector"),
    (lambda raw: raw.update(layer_types=["sliding_attention"] * 2), r"ask for sliding-window attention"),
    (lambda raw: raw["dflash_config"].pop("mask_token_id"), r"mask_token_id None must be an id of the target's"),
    (lambda raw: raw["dflash_config"].update(target_layer_ids=[0, 2]), r"target_layer_ids \[0, 2\] must be layers 0 .. 1"),
    (lambda raw: raw.update(num_target_layers=4), r"has num_target_layers 4; target .* has 2 layers"),
])  # fmt: skip
def test_a_checkpoint_this_server_cannot_serve_is_refused_naming_the_key(pair, tmp_path, edit, message):
    _, target_dir, head_dir = pair
    (tmp_path / "head").mkdir()
    raw = json.loads((head_dir / "config.json").read_text())
    edit(raw)
    (tmp_path / "head" / "config.json").write_text(json.dumps(raw))
    save_file(load_file(head_dir / "model.safetensors"), tmp_path / "head" / "model.safetensors")
    with pytest.raises(ValueError, match=message):
        build_head_proposer("dflash", tmp_path / "head", target_dir)


def test_missing_weights_are_refused_naming_them(pair, tmp_path):
    _, target_dir, head_dir = pair
    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "config.json").write_text((head_dir / "config.json").read_text())
    weights = load_file(head_dir / "model.safetensors")
    save_file({n: t for n, t in weights.items() if n != "layers.1.self_attn.k_norm.weight"},
              tmp_path / "head" / "model.safetensors")  # fmt: skip
    with pytest.raises(ValueError, match=r"missing \['layers.1.self_attn.k_norm.weight'\]"):
        load_dflash(tmp_path / "head", target_dir, torch.float32, "cpu")
