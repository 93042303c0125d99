"""The target's own MTP layer (specdec.heads.mtp, specdec.proposers.mtp): loading, refusals, losslessness, rollback."""
from __future__ import annotations

import hashlib
import sys
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from eagle3_heads import PROMPTS, VOCAB
from test_eagle3 import decode_every_prompt_as_hf
from test_sampled_losslessness import NUM_SAMPLES, CountingSampler, chisquare_pvalue, exact_joint, sample_first_tokens
from tiny_llama import build_tiny_llama
from specdec.cached_lm import ForwardCall
from specdec.fast.checkpoint import read_config
from specdec.fast.runner import FastCausalLM
from specdec.heads import build_head_proposer, check_head
from specdec.heads.cuda_graphs import StaticHeadRunner
from specdec.heads.mtp import MTPConfig, MTPHead, layer_tensors, load_mtp, train_forward, write_into_target
from specdec.models import CachedCausalLM, load_causal_lm
from specdec.rejection_sampler import RejectionSampler
from specdec.sampling import process_logits
from specdec.tree import parse_token_tree
from specdec.types import ProposeRequest, SamplingParams
from specdec.verifier import TargetVerifier
from specdec_triton import speculative_config


def random_mtp(target_dir, seed: int, scale: float = 0.3) -> MTPHead:
    arch = read_config(target_dir)
    torch.manual_seed(seed)
    head = MTPHead(MTPConfig(replace(arch, num_layers=1), arch.num_layers, 1))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, scale) if p.dim() > 1 else p.fill_(1.0)
    return head


def tensors(path) -> dict[str, bytes]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {n: f.get_tensor(n).view(torch.uint8).numpy().tobytes() for n in f.keys()}


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory):
    """A 6-layer Llama target with a random MTP layer written into its checkpoint (layer 6), and the
    target's tensors and greedy logits of a prompt from before the write."""
    root = tmp_path_factory.mktemp("mtp")
    target = build_tiny_llama(seed=0, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=6, initializer_range=0.3)
    target.save_pretrained(root / "target")
    before = tensors(root / "target")
    added = write_into_target(random_mtp(root / "target", 1), root / "target")
    return target, root / "target", before, added


def test_the_layer_is_added_beside_unchanged_tensors_and_model_loaders_skip_it(mtp_target, capfd):
    target, target_dir, before, added = mtp_target
    after = tensors(target_dir)
    assert {n: after[n] for n in before} == before  # every tensor of the model byte for byte
    assert sorted(after.keys() - before.keys()) == added
    assert "model.layers.6.eh_proj.weight" in added and "model.layers.6.shared_head.norm.weight" in added
    assert not any("embed_tokens" in n or "shared_head.head" in n for n in added)  # shared with the model
    assert json.loads((target_dir / "config.json").read_text())["num_nextn_predict_layers"] == 1
    capfd.readouterr()
    loaded = load_causal_lm(target_dir, dtype="float32")
    assert "UNEXPECTED" not in "".join(capfd.readouterr())  # transformers says nothing of the MTP layer
    ids = torch.tensor([PROMPTS[3]])
    torch.testing.assert_close(loaded(ids).logits, target(ids).logits, atol=0, rtol=0)
    fast = FastCausalLM(target_dir, max_num_seqs=1)  # its strict load holds the model's tensors alone
    logits = fast.forward([ForwardCall("s", 0, PROMPTS[3], len(PROMPTS[3]))])
    torch.testing.assert_close(logits[0], target(ids).logits[0], atol=1e-4, rtol=1e-4)


# sha256 over the sorted names and bytes of the shipped target's tensors before its MTP layer was added
SHIPPED_MODEL_TENSORS = "ce2d6b41259633520d223a228ebf11bec3afe607ef1590cd64fd7828369639c7"


def test_the_shipped_target_carries_a_layer_beside_the_tensors_it_shipped_with(capfd):
    path = Path(__file__).resolve().parent.parent / "models" / "tiny-target"
    digest = hashlib.sha256()
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        own = sorted(n for n in f.keys() if not n.startswith("model.layers.6."))
        for name in own:
            digest.update(name.encode())
            digest.update(f.get_tensor(name).view(torch.uint8).numpy().tobytes())
    assert digest.hexdigest() == SHIPPED_MODEL_TENSORS and len(own) == 56
    assert load_mtp(path, torch.float32, "cpu").config.aux_layers == (6,)
    capfd.readouterr()
    load_causal_lm(path, dtype="float32")
    assert "UNEXPECTED" not in "".join(capfd.readouterr())


def test_the_loader_reads_back_what_was_written(mtp_target):
    _, target_dir, _, _ = mtp_target
    head = load_mtp(target_dir, torch.float32, "cpu")
    expected = layer_tensors(random_mtp(target_dir, 1))
    assert layer_tensors(head).keys() == expected.keys()
    for name, tensor in layer_tensors(head).items():  # the checkpoint's dtype (float32 here), exactly
        torch.testing.assert_close(tensor, expected[name], atol=0, rtol=0)
    with safe_open(str(target_dir / "model.safetensors"), framework="pt") as f:
        torch.testing.assert_close(head.embed_tokens.weight, f.get_tensor("model.embed_tokens.weight"))
    assert head.config.aux_layers == (6,)  # the final normed hidden state, as vLLM feeds it


def test_a_target_without_its_layers_or_a_tree_is_refused_by_name(mtp_target, tmp_path):
    target, target_dir, _, _ = mtp_target
    target.save_pretrained(tmp_path / "plain")
    with pytest.raises(ValueError, match=r"has none \(num_nextn_predict_layers = None"):
        build_head_proposer("mtp", tmp_path / "plain", tmp_path / "plain")
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        check_head("mtp", tmp_path / "plain", tmp_path / "plain")
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    (tmp_path / "plain" / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    with pytest.raises(ValueError, match=r"lacks the MTP layer's weights \['model.layers.6.enorm.weight'"):
        build_head_proposer("mtp", tmp_path / "plain", tmp_path / "plain")
    proposer = build_head_proposer("mtp", target_dir, target_dir)
    with pytest.raises(ValueError, match=r"shape \(4, 10\); the MTP layer reads \[n, 32\] \(layers \(6,\)"):
        proposer.propose([ProposeRequest("s", 0, [1, 2, 3, 4, 5], 2, SamplingParams(), 0, hidden_states=torch.zeros(4, 10))])
    with pytest.raises(ValueError, match="method 'mtp' drafts a chain only"):
        build_head_proposer("mtp", target_dir, target_dir, tree=parse_token_tree("[(0,), (1,), (0, 0)]"))
    with pytest.raises(speculative_config.SpeculativeConfigError, match="key 'model' with method 'mtp'"):
        speculative_config.parse('{"method": "mtp", "model": "/models/x"}')
    assert speculative_config.parse('{"method": "mtp", "num_speculative_tokens": 2}')["draft_proposer"] == {
        "method": "mtp"}


@pytest.mark.parametrize("engine", ["fast", "hf"])
def test_greedy_output_equals_hf_generate_at_k_1_to_4(mtp_target, engine):
    """k up to 4 chains the one layer up to 4 times; the output is the target's alone."""
    target, target_dir, _, _ = mtp_target
    lm = FastCausalLM(target_dir, max_num_seqs=4) if engine == "fast" else CachedCausalLM(target)
    verifier = TargetVerifier(lm)
    proposer = build_head_proposer("mtp", target_dir, target_dir, max_num_seqs=4)
    assert proposer.method == "mtp" and proposer.hidden_state_layers == (6,)
    assert decode_every_prompt_as_hf(target, proposer, verifier, range(1, 5)) > 0, "the accepted path must run"
    assert verifier.num_active_sequences == 0 and proposer.num_active_sequences == 0


def test_drafts_equal_the_training_recurrence_and_rolled_back_rows_are_forgotten(mtp_target):
    """The cached proposer computes what ``train_forward`` trains; after drafts are rejected, the rows built
    from them are dropped: the next drafts equal those of a proposer sent only the kept tokens."""
    _, target_dir, _, _ = mtp_target
    head = load_mtp(target_dir, torch.float32, "cpu")
    lm = FastCausalLM(target_dir, max_num_seqs=2)
    tokens = PROMPTS[3]
    _, hidden = lm.forward_with_hidden([ForwardCall("s", 0, tokens[:-1], 1)], (6,))
    sampling = SamplingParams(temperature=1.0)
    proposer = build_head_proposer("mtp", target_dir, target_dir, max_num_seqs=2)
    [proposal] = proposer.propose([ProposeRequest("s", 0, tokens, 3, sampling, 7, hidden_states=hidden[0])])
    full = tokens + proposal.token_ids.tolist()
    n = len(tokens)
    features = torch.zeros(1, len(full) - 1, head.config.feature_size)
    features[0, : n - 1] = hidden[0]
    with torch.no_grad():
        steps = train_forward(head, torch.tensor([full[1:]]), features, num_steps=3)
    for j in range(3):  # q: the layer's processed distribution over the target's vocabulary
        expected = process_logits(steps[j][0, n - 2 + j : n - 1 + j].float(), sampling)  # [1, vocab]
        torch.testing.assert_close(proposal.probs[j : j + 1], expected, atol=1e-4, rtol=1e-4)

    # the target verified the drafts, accepted none and sent its own token: the rows past n - 2 are stale
    greedy = SamplingParams()
    cut = n - 6  # and a cut deeper than the drafts: the sequence rewound to its first n - 6 tokens
    kept, fresh = tokens[:cut] + [5, 9], build_head_proposer("mtp", target_dir, target_dir, max_num_seqs=1)
    _, kept_hidden = lm.forward_with_hidden([ForwardCall("r", 0, kept[:-1], 1)], (6,))
    [rolled] = proposer.propose([ProposeRequest("s", cut, kept[cut:], 4, greedy, 0,
                                                hidden_states=kept_hidden[0][cut - 1 :], hidden_position=cut - 1)])
    [expected] = fresh.propose([ProposeRequest("r", 0, kept, 4, greedy, 0, hidden_states=kept_hidden[0])])
    assert rolled.token_ids.tolist() == expected.token_ids.tolist()


@pytest.mark.slow
def test_speculative_sampling_with_the_layer_matches_the_target_distribution(tmp_path):
    """The chi-square test of ``test_sampled_losslessness`` with the MTP layer's ``q``."""
    target = build_tiny_llama(seed=0, vocab_size=16, hidden_size=16, num_hidden_layers=1, initializer_range=0.3)
    target.save_pretrained(tmp_path / "target")
    write_into_target(random_mtp(tmp_path / "target", 3, scale=0.5), tmp_path / "target")
    proposer = build_head_proposer("mtp", tmp_path / "target", tmp_path / "target", max_num_seqs=2)
    sampler = CountingSampler(RejectionSampler("probabilistic"))
    counts = sample_first_tokens(target, None, sampler, NUM_SAMPLES, proposer=proposer)  # 4 drafts a step
    assert sampler.accepted > 200 and sampler.drafted - sampler.accepted > 200, (sampler.accepted, sampler.drafted)
    assert chisquare_pvalue(counts, exact_joint(target)) > 1e-3



def test_the_layer_built_for_training_starts_from_the_target_and_loads_as_trained(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    from train_mtp import build_mtp, mtp_loss

    target = build_tiny_llama(seed=0, vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, initializer_range=0.3)
    target.save_pretrained(tmp_path / "target")
    head = build_mtp(target, read_config(tmp_path / "target"))
    last = target.model.layers[-1]
    torch.testing.assert_close(head.layers[0].mlp.down_proj.weight, last.mlp.down_proj.weight)
    assert not head.embed_tokens.weight.requires_grad and not head.lm_head.weight.requires_grad  # the target's
    window = torch.tensor([PROMPTS[3][:12]])  # [1, T]
    out = target(window, output_hidden_states=True)
    features, logp = out.hidden_states[-1], out.logits.log_softmax(-1)  # the final normed state, as served
    loss = mtp_loss(head, window, features, logp, ttt_steps=2)
    loss.backward()
    assert loss.isfinite() and head.layers[0].eh_proj.weight.grad.abs().sum() > 0
    write_into_target(head, tmp_path / "target")
    loaded = load_mtp(tmp_path / "target", torch.float32, "cpu")
    with torch.no_grad():
        for a, b in zip(train_forward(head, window[:, 1:], features[:, :-1], 2),
                        train_forward(loaded, window[:, 1:], features[:, :-1], 2)):
            torch.testing.assert_close(a, b)


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                           reason="needs CUDA")]),
])  # fmt: skip
def test_fixed_shape_passes_of_the_layer_are_lossless(mtp_target, device):
    """The layer's passes at fixed shapes (captured on CUDA, the same passes uncaptured on CPU), as EAGLE-3's
    run: the output stays HF's."""
    target, target_dir, _, _ = mtp_target
    lm = FastCausalLM(target_dir, dtype="float32", device=device, max_num_seqs=4)
    proposer = build_head_proposer("mtp", target_dir, target_dir, "float32", device, max_num_seqs=4)
    if device == "cpu":
        proposer.graphs = StaticHeadRunner(proposer.head, proposer.cache)
    assert proposer.graphs is not None
    assert decode_every_prompt_as_hf(target, proposer, TargetVerifier(lm), (1, 3)) > 0
