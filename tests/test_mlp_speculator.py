"""The MLP speculator: its published layout, its proposer over the target's last hidden state, losslessness."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from tiny_llama import build_tiny_llama, hf_generate_greedy
from specdec.engine import GenerationParams
from specdec.generate import generate
from specdec.fast.runner import FastCausalLM
from specdec.heads import build_head_proposer
from specdec.heads.mlp_speculator import MLPSpeculator, first_stages, load_mlp_speculator, save_mlp_speculator
from specdec.models import CachedCausalLM
from specdec.rejection_sampler import RejectionSampler
from specdec.types import ProposeRequest, SamplingParams
from specdec.verifier import TargetVerifier
from test_sampled_losslessness import (
    NUM_SAMPLES, CountingSampler, chisquare_pvalue, exact_joint, sample_first_tokens,
)  # fmt: skip

VOCAB, HIDDEN, N_PREDICT = 12, 32, 3  # a small vocabulary: a random speculator is sometimes right
PROMPTS = [[3, 7, 1, 11, 10], [5], [9, 9, 9, 2, 2, 2, 9, 9], [i % 11 + 1 for i in range(20)]]


def write_speculator(out, vocab: int, hidden: int, n_predict: int, tie: bool, seed: int = 1) -> MLPSpeculator:
    torch.manual_seed(seed)
    config = dict(n_predict=n_predict, emb_dim=hidden, inner_dim=16, vocab_size=vocab, tie_weights=tie,
                  scale_input=True, top_k_tokens_per_head=[1] * n_predict)  # fmt: skip
    model = MLPSpeculator(config)
    save_mlp_speculator(model, out)
    return model


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlp")
    target = build_tiny_llama(seed=0, vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, initializer_range=0.3)
    target.save_pretrained(root / "target")
    write_speculator(root / "head", VOCAB, HIDDEN, N_PREDICT, tie=False)
    return target, root / "target", root / "head"


@pytest.mark.parametrize("tie", [False, True])
def test_published_layout_round_trips(tmp_path, pair, tie):
    _, target_dir, _ = pair
    model = write_speculator(tmp_path / "head", VOCAB, HIDDEN, N_PREDICT, tie)
    raw = json.loads((tmp_path / "head" / "config.json").read_text())
    assert raw["model_type"] == "mlp_speculator" and raw["n_predict"] == N_PREDICT and raw["tie_weights"] is tie
    loaded = load_mlp_speculator(tmp_path / "head", target_dir, torch.float32, "cpu")
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)
    if tie:  # one embedding, head and norm for every stage
        assert loaded.emb[0] is loaded.emb[N_PREDICT - 1] and loaded.proj[1] is loaded.proj[N_PREDICT - 1]


def test_a_pytorch_model_bin_loads_and_a_misshapen_weight_is_named(tmp_path, pair):
    _, target_dir, _ = pair
    model = write_speculator(tmp_path / "head", VOCAB, HIDDEN, N_PREDICT, tie=False)
    weights = load_file(tmp_path / "head" / "model.safetensors")
    (tmp_path / "head" / "model.safetensors").unlink()
    torch.save({f"speculator.{k}": v for k, v in weights.items()}, tmp_path / "head" / "pytorch_model.bin")
    loaded = load_mlp_speculator(tmp_path / "head", target_dir, torch.float32, "cpu")
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(loaded.state_dict()[name], tensor)
    torch.save({**weights, "proj.0.weight": weights["proj.0.weight"][:, :-1]}, tmp_path / "head" / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"proj.0.weight is \(16, 31\), its config.json makes it \(16, 32\)"):
        load_mlp_speculator(tmp_path / "head", target_dir, torch.float32, "cpu")


@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_greedy_output_equals_hf_generate_for_every_k_up_to_n_predict(pair, engine):
    target, target_dir, head_dir = pair
    lm = FastCausalLM(target_dir, max_num_seqs=4) if engine == "fast" else CachedCausalLM(target)
    verifier, proposer = TargetVerifier(lm), build_head_proposer("mlp_speculator", head_dir, target_dir)
    assert proposer.hidden_state_layers == (2,)  # the final normed state of a 2-layer target
    accepted = 0
    for k in range(1, N_PREDICT + 1):
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


def test_more_drafts_than_n_predict_and_another_target_are_refused_by_name(pair, tmp_path):
    _, target_dir, head_dir = pair
    proposer = build_head_proposer("mlp_speculator", head_dir, target_dir)
    request = ProposeRequest("s", 0, [1, 2], N_PREDICT + 1, SamplingParams(), 0, hidden_states=torch.zeros(1, HIDDEN))
    with pytest.raises(ValueError, match=rf"{N_PREDICT + 1} drafts asked of an MLP speculator with n_predict=3"):
        proposer.propose([request])
    with pytest.raises(ValueError, match=r"after 2 tokens needs the target's hidden state at position 0, the proposer "
                                         r"has it at -1"):  # fmt: skip
        proposer.propose([ProposeRequest("s", 0, [1, 2], 2, SamplingParams(), 0)])
    other = tmp_path / "other"
    build_tiny_llama(seed=2, vocab_size=VOCAB, hidden_size=48, num_hidden_layers=2).save_pretrained(other)
    with pytest.raises(ValueError, match=rf"MLP speculator '{head_dir}' \(emb_dim 32, vocab_size 12\) does not fit "
                                         rf"target '{other}' \(hidden size 48"):  # fmt: skip
        build_head_proposer("mlp_speculator", head_dir, other)


@pytest.mark.slow
def test_speculative_sampling_with_the_speculator_matches_the_target_distribution(tmp_path):
    target = build_tiny_llama(seed=0, vocab_size=16, hidden_size=16, num_hidden_layers=1, initializer_range=0.3)
    target.save_pretrained(tmp_path / "target")
    write_speculator(tmp_path / "head", 16, 16, 4, tie=False, seed=3)
    proposer = build_head_proposer("mlp_speculator", tmp_path / "head", tmp_path / "target")
    sampler = CountingSampler(RejectionSampler("probabilistic"))
    counts = sample_first_tokens(target, None, sampler, NUM_SAMPLES, proposer=proposer)  # 4 drafts a step
    assert sampler.accepted > 200 and sampler.drafted - sampler.accepted > 200, (sampler.accepted, sampler.drafted)
    assert chisquare_pvalue(counts, exact_joint(target)) > 1e-3


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.parametrize("stages", [1, 3])
def test_a_speculator_cut_to_its_first_stages_computes_what_they_computed(tmp_path, tie, stages):
    model = write_speculator(tmp_path, vocab=64, hidden=32, n_predict=4, tie=tie)
    with torch.no_grad():
        for p in model.parameters():  # away from the initial values, where a missed rescale could hide
            p.add_(torch.randn_like(p) * 0.1)
    cut = first_stages(model, stages)
    assert cut.n_predict == stages and cut.config["n_predict"] == stages
    assert model.n_predict == 4  # the original is untouched
    hidden, tokens = torch.randn(5, 32), torch.randint(0, 64, (stages, 5))
    state, cut_state = model.first_state(hidden), cut.first_state(hidden)
    for i in range(stages):
        logits, state = model.stage(i, state, tokens[i])
        cut_logits, cut_state = cut.stage(i, cut_state, tokens[i])
        torch.testing.assert_close(cut_logits, logits)
    if stages < 4:  # without the rescale the stages' inputs would differ
        assert cut.emb_weight / cut.state_weight != pytest.approx(model.emb_weight / model.state_weight)


@pytest.mark.parametrize("stages", [0, 5])
def test_a_cut_outside_the_speculators_stages_is_refused(tmp_path, stages):
    with pytest.raises(ValueError, match="n_predict"):
        first_stages(write_speculator(tmp_path, vocab=64, hidden=32, n_predict=4, tie=False), stages)
