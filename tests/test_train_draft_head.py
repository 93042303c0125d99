"""The head trainer: its training windows (written text, and the target's own greedy continuations of
it), the MLP speculator and the Medusa heads it builds."""
from __future__ import annotations

import math
import sys
from argparse import Namespace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

from tiny_llama import build_tiny_llama, hf_generate_greedy  # noqa: E402
from specdec.heads.mlp_speculator import load_mlp_speculator, save_mlp_speculator  # noqa: E402
from specdec.heads.medusa import load_medusa, save_medusa  # noqa: E402
from train_draft_head import build_medusa, build_mlp, medusa_loss, mlp_loss, training_windows  # noqa: E402

SEQ_LEN = 14  # windows of SEQ_LEN + 2 = 16 tokens
PROMPT = 6


def windows_args(share: float, prompt: int = PROMPT) -> Namespace:
    return Namespace(seed=0, seq_len=SEQ_LEN, windows=10, generated_share=share, generated_prompt_tokens=prompt)


def occurs_in(row: torch.Tensor, data: torch.Tensor) -> bool:
    spans = data.unfold(0, len(row), 1)  # [len(data) - len(row) + 1, len(row)]
    return bool((spans == row).all(-1).any())


@pytest.fixture(scope="module")
def text() -> torch.Tensor:
    return torch.randint(0, 256, (3000,), generator=torch.Generator().manual_seed(7))  # [3000]


def test_without_a_generated_share_every_window_is_text(text):
    windows = training_windows(build_tiny_llama(seed=0), text, windows_args(0.0))
    assert windows.shape == (10, SEQ_LEN + 2)
    assert all(occurs_in(row, text) for row in windows)


def test_a_generated_window_is_its_text_start_then_the_targets_greedy_continuation(text):
    target = build_tiny_llama(seed=0)
    plain = training_windows(target, text, windows_args(0.0))
    mixed = training_windows(target, text, windows_args(0.5))
    assert torch.equal(mixed[5:], plain[5:])  # the same seeded text windows, untouched
    assert torch.equal(mixed[:5, :PROMPT], plain[:5, :PROMPT])
    for row in mixed[:5]:
        expected = hf_generate_greedy(target, row[:PROMPT].tolist(), SEQ_LEN + 2 - PROMPT,
                                      min_new_tokens=SEQ_LEN + 2 - PROMPT)  # fmt: skip
        assert row[PROMPT:].tolist() == expected
    assert not all(occurs_in(row, text) for row in mixed[:5])  # the continuation is the target's, not the text's


@pytest.mark.parametrize("prompt", [0, SEQ_LEN + 2])
def test_a_prompt_that_leaves_no_room_is_refused_by_name(text, prompt):
    with pytest.raises(SystemExit, match="--generated-prompt-tokens"):
        training_windows(build_tiny_llama(seed=0), text, windows_args(0.5, prompt))


@pytest.mark.parametrize("tie", [False, True])
def test_the_mlp_speculator_built_for_training_starts_from_the_targets_lm_head_and_loads_as_served(tie, tmp_path):
    """``--tie-weights``: one embedding, head and norm for every stage, written once and loaded as vLLM loads it."""
    target = build_tiny_llama(seed=0)
    target.save_pretrained(tmp_path / "target")
    args = Namespace(n_predict=3, inner_dim=0, tie_weights=tie)
    speculator = build_mlp(target, target.config, args)
    assert all(torch.equal(head.weight, target.lm_head.weight) for head in speculator.head)
    assert (speculator.emb[0] is speculator.emb[2]) == tie and (speculator.proj[1] is speculator.proj[2]) == tie
    with torch.no_grad():
        for p in speculator.parameters():
            p.add_(torch.randn_like(p) * 0.1)  # trained weights, not the start
    save_mlp_speculator(speculator, tmp_path / "head")
    loaded = load_mlp_speculator(tmp_path / "head", tmp_path / "target", torch.float32, "cpu")
    assert loaded.config["tie_weights"] == tie and (loaded.emb[0] is loaded.emb[2]) == tie
    hidden, tokens = torch.randn(2, target.config.hidden_size), torch.tensor([3, 5])  # [B, h], [B]
    state, expected_state = loaded.first_state(hidden), speculator.first_state(hidden)
    for i in range(3):
        logits, state = loaded.stage(i, state, tokens)
        expected, expected_state = speculator.stage(i, expected_state, tokens)
        assert torch.allclose(logits, expected)


def test_the_mlp_speculators_loss_scores_each_stage_on_the_targets_distribution_or_its_greedy_token():
    target = build_tiny_llama(seed=0)
    speculator = build_mlp(target, target.config, Namespace(n_predict=2, inner_dim=0, tie_weights=False))
    window = torch.randint(1, target.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))  # [B, T]
    with torch.no_grad():
        out = target(window, output_hidden_states=True)
    last, target_logp = out.hidden_states[-1], out.logits.log_softmax(-1)  # [B, T, h], [B, T, vocab]
    span = window.shape[1] - 2
    state, soft, hard = speculator.first_state(last[:, :span]), [], []
    for i in range(2):  # stage i at base t reads x_{t+1+i}, scored at t + 1 + i
        logits, state = speculator.stage(i, state, window[:, 1 + i : 1 + i + span])
        labels = target_logp[:, 1 + i : 1 + i + span]
        soft.append(-(labels.exp() * logits.log_softmax(-1)).sum(-1).mean())
        hard.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.argmax(-1).flatten()))
    assert torch.allclose(mlp_loss(speculator, window, last, target_logp), sum(soft) / 2, atol=1e-5)
    assert torch.allclose(mlp_loss(speculator, window, last, target_logp, greedy_labels=True), sum(hard) / 2, atol=1e-4)


@pytest.mark.parametrize("lm_head", ["shared", "own"])
def test_medusa_starts_as_the_targets_next_token_head_and_loads_as_served(lm_head, tmp_path):
    """Zero blocks are the identity: each head starts with the target's logits; ``shared`` keeps the target's
    LM head, frozen, as the format's one ``original_lm_head``."""
    target = build_tiny_llama(seed=0)
    target.save_pretrained(tmp_path / "target")
    medusa = build_medusa(target, target.config, Namespace(medusa_heads=3, medusa_layers=2, medusa_lm_head=lm_head))
    hidden = torch.randn(2, target.config.hidden_size)
    with torch.no_grad():
        expected = target.lm_head(hidden)
        assert all(torch.allclose(logits, expected) for logits in medusa(hidden))
    assert len(medusa.lm_heads) == (1 if lm_head == "shared" else 3)
    assert medusa.lm_heads[0].weight.requires_grad == (lm_head == "own")
    with torch.no_grad():
        for block in medusa.blocks:
            for p in block.parameters():
                p.add_(torch.randn_like(p) * 0.1)  # trained weights, not the start
    save_medusa(medusa, tmp_path / "head")
    loaded = load_medusa(tmp_path / "head", tmp_path / "target", torch.float32, "cpu")
    assert loaded.config == medusa.config
    assert torch.allclose(loaded(hidden), medusa(hidden))


def test_medusas_loss_scores_head_i_at_t_on_the_targets_distribution_at_t_plus_1_plus_i():
    target = build_tiny_llama(seed=0)
    medusa = build_medusa(target, target.config, Namespace(medusa_heads=2, medusa_layers=1, medusa_lm_head="own"))
    window = torch.randint(1, target.config.vocab_size, (2, 8), generator=torch.Generator().manual_seed(1))  # [B, T]
    with torch.no_grad():
        out = target(window, output_hidden_states=True)
    last, target_logp = out.hidden_states[-1], out.logits.log_softmax(-1)  # [B, T, h], [B, T, vocab]
    span = window.shape[1] - 2
    losses = []
    for i in range(2):  # head i reads the state at t only, scored at t + 1 + i
        logits = medusa(last[:, :span])[i]
        labels = target_logp[:, 1 + i : 1 + i + span]
        losses.append(-(labels.exp() * logits.log_softmax(-1)).sum(-1).mean())
    assert torch.allclose(medusa_loss(medusa, window, last, target_logp), sum(losses) / 2, atol=1e-5)


def test_dflash_trains_each_block_as_the_served_proposer_drafts_it(tmp_path):
    """Every block of a window, attending to the context before its anchor and to itself only (the
    block-sparse mask), has the logits a served step computes for the same sequence; the loss scores
    block position j on the target's row anchor + j - 1, and the layers start from the target's."""
    from specdec.fast.checkpoint import read_config
    from specdec.heads import build_head_proposer
    from specdec.heads.dflash import save_dflash
    from specdec.types import ProposeRequest, SamplingParams
    from train_dflash import block_logits, build_dflash, dflash_loss

    target = build_tiny_llama(seed=0, vocab_size=40, hidden_size=32, num_hidden_layers=4, initializer_range=0.3)
    target.save_pretrained(tmp_path / "target")
    args = Namespace(block_size=4, target_layer_ids="1,3", num_layers=2, dflash_init_layers="last", seed=0)
    model = build_dflash(target, read_config(tmp_path / "target"), args, torch.randint(1, 39, (500,)))
    assert torch.equal(model.layers[1].mlp.up_proj.weight, target.model.layers[3].mlp.up_proj.weight)
    assert model.config.hidden_state_layers == (2, 4) and model.config.mask_token_id == 39  # never drawn: rarest
    with torch.no_grad():
        for p in model.fc.parameters():
            p.add_(torch.randn_like(p))
    save_dflash(model, tmp_path / "head")
    window = torch.randint(1, 39, (1, 12), generator=torch.Generator().manual_seed(1))  # [1, T]
    with torch.no_grad():
        out = target(window, output_hidden_states=True)
        features = torch.cat([out.hidden_states[i] for i in (2, 4)], -1)  # [1, T, 64]
        anchors = torch.tensor([[3, 5, 9]])  # [1, A]
        trained = block_logits(model, window, features, anchors)  # [1, A, 3, vocab]
    proposer = build_head_proposer("dflash", tmp_path / "head", tmp_path / "target")
    for i, a in enumerate(anchors[0].tolist()):  # a served sequence of a + 1 tokens: context 0 .. a - 1
        (proposal,) = proposer.propose([ProposeRequest(f"s{a}", 0, window[0, : a + 1].tolist(), 3, SamplingParams(),
                                                       0, hidden_states=features[0, :a])])  # fmt: skip
        assert proposal.token_ids.tolist() == trained[0, i].argmax(-1).tolist(), a
    logp = out.logits.log_softmax(-1)
    per_row = [-(logp[0, a + j].exp() * trained[0, i, j].log_softmax(-1)).sum()
               for i, a in enumerate(anchors[0].tolist()) for j in range(3)]  # position j + 1: row a + j
    weights = torch.tensor([1.0, math.exp(-1 / 2), math.exp(-2 / 2)] * 3)
    want = (torch.stack(per_row) * weights).sum() / 3 / weights[:3].sum()
    torch.testing.assert_close(dflash_loss(model, window, features, logp, anchors, decay=2.0), want)
