"""EAGLE-3: the head's proposer (cached, compiled, fixed-shape, on the device), the rows the
target sends it, and losslessness with it (tests/eagle3_heads.py builds the random heads;
tests/test_eagle3_formats.py loads and refuses them)."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch._dynamo.utils import counters

from eagle3_heads import (DRAFT_VOCAB, NUM_NEW_TOKENS, PROMPTS, VOCAB, greedy_drafts, heads, pair, random_head,
                          two_layer_pair)
from tiny_llama import build_tiny_llama, hf_generate_greedy
from specdec.cached_lm import ForwardCall
from specdec.engine import GenerationParams
from specdec.generate import generate
from specdec.fast.checkpoint import read_config
from specdec.fast.runner import FastCausalLM
from specdec.fast.cuda_graphs import StaticShapeRunner
from specdec.heads import build_head_proposer
from specdec.heads.compiled_steps import STEPS_PER_CALL
from specdec.heads.cuda_graphs import StaticHeadRunner
from specdec.heads.eagle3 import eagle3_config_for, train_forward
from specdec.heads.formats import load_eagle3, save_eagle3
from specdec.models import CachedCausalLM
from specdec.rejection_sampler import RejectionSampler
from specdec.sampling import greedy_tokens, process_logits
from specdec.types import ProposeRequest, SamplingParams
from specdec.verifier import TargetVerifier
from test_sampled_losslessness import NUM_SAMPLES, CountingSampler, chisquare_pvalue, exact_joint, sample_first_tokens

__all__ = ["heads", "pair", "two_layer_pair"]  # fixtures



@pytest.fixture(scope="module")
def compiled_two_layers(two_layer_pair):
    """The two-layer head (the shipped depth) compiled for CPU, built once for this module's compiled checks:
    a build compiles every step shape at load, two minutes on a cold cache. Each check releases its sequences."""
    _, target_dir, head_dir = two_layer_pair
    return build_head_proposer("eagle3", head_dir, target_dir, max_num_seqs=4, cpu_compile=True)


@pytest.mark.parametrize("heads,cpu_compile,packed", [
    ("one-layer", False, False), ("two-layers", False, False), ("two-layers", True, False), ("one-layer", True, True),
], ids=["one-layer-eager", "two-layers-eager", "two-layers-compiled", "one-layer-compiled-packed"], indirect=["heads"])
def test_drafts_equal_the_training_time_test_recurrence(heads, cpu_compile, packed, monkeypatch, request):
    """The cached, position-addressed proposer computes what ``train_forward`` trains, step for step.

    ``packed``: every linear prepacked for oneDNN, as the shipped head's are (the test head's are too small).
    Compiled once per head depth, not for both depths twice: each compiled head takes a minute on a cold cache.
    """
    if packed:
        monkeypatch.setattr("specdec.fast.cpu_linear.PACK_MIN_ELEMENTS", 0)
    target, target_dir, head_dir = heads
    head = load_eagle3(head_dir, target_dir, torch.float32, "cpu")
    if cpu_compile and not packed:
        proposer = request.getfixturevalue("compiled_two_layers")
    else:
        proposer = build_head_proposer("eagle3", head_dir, target_dir, max_num_seqs=4, cpu_compile=cpu_compile)
    lm = FastCausalLM(target_dir, max_num_seqs=2)
    tokens = PROMPTS[3]  # the target verified tokens[:-1]; tokens[-1] is its latest output
    _, hidden = lm.forward_with_hidden([ForwardCall("s", 0, tokens[:-1], 1)], head.config.aux_layers)
    sampling = SamplingParams(temperature=1.0)
    split = 9  # two requests: the features arrive in pieces, as they do step by step
    proposer.propose([ProposeRequest("s", 0, tokens[:split + 1], 1, sampling, 1, hidden_states=hidden[0][:split])])
    [proposal] = proposer.propose([ProposeRequest("s", split + 1, tokens[split + 1 :], 3, sampling, 2,
                                                  hidden_states=hidden[0][split:], hidden_position=split)])  # fmt: skip
    proposer.release("s")
    drafts = proposal.token_ids.tolist()
    full = tokens + drafts
    n = len(tokens)
    features = torch.zeros(1, len(full) - 1, head.config.feature_size)
    features[0, : n - 1] = hidden[0]
    with torch.no_grad():
        steps = train_forward(head, torch.tensor([full[1:]]), features, num_steps=3)
    for j in range(3):
        expected = process_logits(head.target_logits(steps[j][0, n - 2 + j : n - 1 + j]), sampling)  # [1, vocab]
        torch.testing.assert_close(proposal.probs[j : j + 1], expected, atol=1e-4, rtol=1e-4)
    assert proposal.probs[:, ~head.t2d].abs().max() == 0  # q only where the draft vocabulary reaches


def test_greedy_drafts_with_banned_ids_are_the_target_vocabulary_argmax(pair):
    """A greedy draft is picked on the draft vocabulary, its banned ids masked there: the same
    token as the argmax of the row put back on the target's vocabulary with those ids banned."""
    _, target_dir, head_dir = pair
    head = load_eagle3(head_dir, target_dir, torch.float32, "cpu")
    lm = FastCausalLM(target_dir, max_num_seqs=2)
    tokens = PROMPTS[3]
    _, hidden = lm.forward_with_hidden([ForwardCall("s", 0, tokens[:-1], 1)], head.config.aux_layers)
    greedy = SamplingParams()

    def first_draft(banned: tuple[int, ...]) -> int:
        proposer = build_head_proposer("eagle3", head_dir, target_dir, max_num_seqs=2)
        [proposal] = proposer.propose([ProposeRequest("s", 0, tokens, 2, greedy, 0, hidden_states=hidden[0],
                                                      num_banned_tokens=1, banned_token_ids=banned)])  # fmt: skip
        return int(proposal.token_ids[0])

    features = hidden[0][None]  # [1, n - 1, F]
    with torch.no_grad():
        [step] = train_forward(head, torch.tensor([tokens[1:]]), features, num_steps=1)
    row = head.target_logits(step[0, -1:])  # [1, vocab]: the first draft's logits
    free = first_draft(())
    assert free == int(greedy_tokens(row))
    banned = (free, int(greedy_tokens(row, 1, (free,))))  # the best two: the third is drafted
    assert first_draft(banned) == int(greedy_tokens(row, 1, banned)) not in banned


def three_prompts_and_features(target_dir, head_dir) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
    """Three prompts by seq_id, and the target's features of each (its tokens but the last) the head reads."""
    lm = FastCausalLM(target_dir, max_num_seqs=4)
    layers = load_eagle3(head_dir, target_dir, torch.float32, "cpu").config.aux_layers
    prompts = {"a": PROMPTS[3], "b": PROMPTS[2], "c": PROMPTS[0]}
    calls = [ForwardCall(s, 0, t[:-1], 1) for s, t in prompts.items()]
    return prompts, dict(zip(prompts, lm.forward_with_hidden(calls, layers)[1]))


def test_greedy_drafts_kept_on_the_device_equal_the_per_step_loop(heads, monkeypatch):
    """Uniform greedy batches feed each draft to the next pass on the device; the drafts are the
    per-step loop's, bans (for the first two drafts of one sequence) included."""
    _, target_dir, head_dir = heads
    prompts, hidden = three_prompts_and_features(target_dir, head_dir)

    def drafts(on_device: bool, k: int, banned: tuple[int, ...]) -> list[list[int]]:
        proposer = build_head_proposer("eagle3", head_dir, target_dir, max_num_seqs=4)
        monkeypatch.setattr(proposer, "uniform_greedy", lambda requests: on_device)
        used = {}
        original = proposer._draft_greedy_on_device
        monkeypatch.setattr(proposer, "_draft_greedy_on_device", lambda *a: used.setdefault("yes", original(*a)))
        requests = [ProposeRequest(s, 0, t, k, SamplingParams(), 0, hidden_states=hidden[s],
                                   num_banned_tokens=2 if s == "b" else 0, banned_token_ids=banned if s == "b" else ())
                    for s, t in prompts.items()]  # fmt: skip
        out = [p.token_ids.tolist() for p in proposer.propose(requests)]
        assert ("yes" in used) == on_device
        return out

    free = drafts(False, 3, ())
    banned = (free[1][0],)  # b's first draft: banned, the drafts change
    assert drafts(False, 3, banned)[1] != free[1]
    for k in (1, 3, 5):
        assert drafts(True, k, banned) == drafts(False, k, banned)


def test_compiled_drafting_steps_equal_the_per_step_loop(two_layer_pair, compiled_two_layers, monkeypatch):
    """With ``cpu_compile``, greedy steps run ``STEPS_PER_CALL`` to a compiled call and the rest a pass a
    call: the drafts are the per-step loop's for every k, bans binding part of a call's steps included.
    One head (the shipped depth): each head's graphs take seconds to compile, more on a cold cache."""
    _, target_dir, head_dir = two_layer_pair
    prompts, hidden = three_prompts_and_features(target_dir, head_dir)
    proposer = compiled_two_layers
    chunks = []
    original = proposer._greedy_steps.run
    monkeypatch.setattr(proposer._greedy_steps, "run", lambda *a: chunks.append(a[0].shape[0]) or original(*a))

    def drafts(on_device: bool, k: int, seq_ids: tuple[str, ...], banned: tuple[int, ...]) -> list[list[int]]:
        monkeypatch.setattr(proposer, "uniform_greedy", lambda requests: on_device)
        return greedy_drafts(proposer, prompts, hidden, seq_ids, k, banned, 3)

    compiles = counters["aot_autograd"]["total"]
    free = drafts(False, 4, ("b",), ())
    banned = (free[0][1], free[0][2])  # b's second and third drafts: banned inside the compiled call
    assert drafts(False, 4, ("b",), banned) != free
    for seq_ids in (("b",), ("a", "b"), ("a", "b", "c")):  # one row and several (more than warmed up)
        for k in (1, 2, 4, 5, 7, 8):
            chunks.clear()
            assert drafts(True, k, seq_ids, banned) == drafts(False, k, seq_ids, banned), (seq_ids, k)
            assert chunks == [len(seq_ids)] * ((k - 1) // STEPS_PER_CALL), (seq_ids, k)
    for seq_ids in (("b",), ("a", "b", "c")):  # sampled: the per-step loop, with its q
        proposer.propose([ProposeRequest(s, 0, prompts[s], 3, SamplingParams(temperature=1.0), 1,
                                         hidden_states=hidden[s]) for s in seq_ids])  # fmt: skip
        for s in seq_ids:
            proposer.release(s)
    assert counters["aot_autograd"]["total"] == compiles, "every graph is compiled at load, none by a request"


@pytest.mark.parametrize("heads,engine", [(h, e) for h in ("one-layer", "two-layers") for e in ("fast", "hf")] +
                         [("two-layers", "fast-compiled")], indirect=["heads"])  # fmt: skip
def test_greedy_output_equals_hf_generate_for_every_k(heads, engine, request):
    target, target_dir, head_dir = heads
    # the target and the head, each compiled for CPU: the two-layer head only, the module's compiled one
    compiled = engine == "fast-compiled"
    lm = FastCausalLM(target_dir, max_num_seqs=4, cpu_compile=compiled) if engine != "hf" else CachedCausalLM(target)
    verifier = TargetVerifier(lm)
    proposer = (request.getfixturevalue("compiled_two_layers") if compiled else
                build_head_proposer("eagle3", head_dir, target_dir, max_num_seqs=4))  # fmt: skip
    assert decode_every_prompt_as_hf(target, proposer, verifier, range(1, 6)) > 0, "the accepted path must run"
    assert verifier.num_active_sequences == 0 and proposer.num_active_sequences == 0


def decode_every_prompt_as_hf(target, proposer, verifier, ks) -> int:
    """Greedy speculative output equals HF generate's for each k and prompt; returns the drafts accepted."""
    accepted = 0
    for k in ks:
        for prompt in PROMPTS:
            params = GenerationParams(max_tokens=NUM_NEW_TOKENS, num_speculative_tokens=k)
            out, stats = [], None
            for step in generate(proposer, verifier, RejectionSampler(), prompt, params):
                out += step.new_token_ids
                stats = step.stats or stats
            assert out == hf_generate_greedy(target, prompt, NUM_NEW_TOKENS), (k, prompt)
            accepted += stats.num_accepted_tokens
    return accepted


def _static_or_graphed(target_dir, head_dir, device: str):
    """Target and head whose passes run at fixed shapes: captured on CUDA, the same passes uncaptured on CPU."""
    lm = FastCausalLM(target_dir, dtype="float32", device=device, max_num_seqs=4)
    proposer = build_head_proposer("eagle3", head_dir, target_dir, "float32", device, max_num_seqs=4)
    if device == "cpu":
        lm.graphs = StaticShapeRunner(lm.model, lm.cache, (1, 2, 4, 8))
        proposer.graphs = StaticHeadRunner(proposer.head, proposer.cache)
    assert lm.graphs is not None and proposer.graphs is not None
    return lm, proposer


@pytest.mark.parametrize("device", [
    "cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                           reason="needs CUDA")]),
])  # fmt: skip
def test_fixed_shape_passes_of_target_and_head_are_lossless(heads, device):
    """The verify passes that export hidden states and the head's passes replay graphs; output stays HF's."""
    target, target_dir, head_dir = heads
    lm, proposer = _static_or_graphed(target_dir, head_dir, device)
    assert decode_every_prompt_as_hf(target, proposer, TargetVerifier(lm), (1, 3, 5)) > 0
    assert set(lm._graphs_with_hidden) == {proposer.hidden_state_layers}  # verify passes with features ran fixed-shape


def test_a_head_narrower_than_the_target_is_lossless_and_keeps_its_own_embedding(pair, tmp_path):
    """``fc`` maps the target's features down to a narrower head (16 wide, grouped-query, against 32)."""
    target, target_dir, _ = pair
    save_eagle3(random_head(target_dir, 4, DRAFT_VOCAB, hidden_size=16), tmp_path / "narrow", verifier="target")
    raw = json.loads((tmp_path / "narrow" / "config.json").read_text())
    assert raw["target_hidden_size"] == 32 and raw["transformer_layer_config"]["hidden_size"] == 16
    assert raw["transformer_layer_config"]["num_key_value_heads"] == 1
    verifier = TargetVerifier(FastCausalLM(target_dir, max_num_seqs=2))
    proposer = build_head_proposer("eagle3", tmp_path / "narrow", target_dir, max_num_seqs=2)
    accepted = 0
    for k in (1, 4):
        for prompt in PROMPTS:
            out, stats = [], None
            for step in generate(proposer, verifier, RejectionSampler(), prompt,
                                 GenerationParams(max_tokens=NUM_NEW_TOKENS, num_speculative_tokens=k)):  # fmt: skip
                out += step.new_token_ids
                stats = step.stats or stats
            assert out == hf_generate_greedy(target, prompt, NUM_NEW_TOKENS), (k, prompt)
            accepted += stats.num_accepted_tokens
    assert accepted > 0, "the accepted path must be exercised"
    weights = load_file(tmp_path / "narrow" / "model.safetensors")
    del weights["embed_tokens.weight"]
    save_file(weights, tmp_path / "narrow" / "model.safetensors")
    with pytest.raises(ValueError, match=r"has no embed_tokens and is 16 wide: it cannot share the 32-wide "
                                         r"embedding of target"):  # fmt: skip
        build_head_proposer("eagle3", tmp_path / "narrow", target_dir)
    with pytest.raises(ValueError, match=r"hidden_size 12 is not a multiple of the target's head_dim 8"):
        eagle3_config_for(read_config(target_dir), DRAFT_VOCAB, hidden_size=12)


def test_missing_or_misfit_hidden_states_are_refused_by_name(pair):
    _, target_dir, head_dir = pair
    proposer = build_head_proposer("eagle3", head_dir, target_dir, max_num_seqs=2)
    greedy = SamplingParams()
    with pytest.raises(ValueError, match=r"5 tokens need the target's hidden states at 4 positions, the proposer has 0"):
        proposer.propose([ProposeRequest("s", 0, [1, 2, 3, 4, 5], 2, greedy, 0)])
    with pytest.raises(ValueError, match=r"hidden_states of shape \(4, 10\); the EAGLE-3 head reads \[n, 96\]"):
        proposer.propose([ProposeRequest("s", 0, [1, 2, 3, 4, 5], 2, greedy, 0, hidden_states=torch.zeros(4, 10))])
    assert proposer.num_active_sequences == 0


@pytest.mark.slow
@pytest.mark.parametrize("num_layers", [1, 2])
def test_speculative_sampling_with_the_head_matches_the_target_distribution(tmp_path, num_layers):
    """The chi-square test of ``test_sampled_losslessness`` with an EAGLE-3 head's ``q``."""
    target = build_tiny_llama(seed=0, vocab_size=16, hidden_size=16, num_hidden_layers=1, initializer_range=0.3)
    target.save_pretrained(tmp_path / "target")
    head = random_head(tmp_path / "target", 3, 12, aux_layers=(0, 1, 1), scale=0.5, num_layers=num_layers)
    save_eagle3(head, tmp_path / "head", verifier="target")
    proposer = build_head_proposer("eagle3", tmp_path / "head", tmp_path / "target", max_num_seqs=2)
    sampler = CountingSampler(RejectionSampler("probabilistic"))
    counts = sample_first_tokens(target, None, sampler, NUM_SAMPLES, proposer=proposer)  # 4 drafts a step
    # a random head is accepted rarely, but hundreds of times: both paths of the sampler run
    assert sampler.accepted > 200 and sampler.drafted - sampler.accepted > 200, (sampler.accepted, sampler.drafted)
    assert chisquare_pvalue(counts, exact_joint(target)) > 1e-3


def test_the_sequence_sends_the_proposer_the_rows_of_the_tokens_that_stay():
    from specdec.engine import SequenceState
    from specdec.types import Proposal, SampleResult, VerifyResult

    state = SequenceState("s", [4, 5, 6], GenerationParams(max_tokens=10, num_speculative_tokens=3), hidden_layers=(1,))
    assert state.verify_request(None).hidden_layers == (1,)
    rows = torch.arange(3.0)[:, None]  # [3, 1]: one row per prompt token, its position as the value
    state.commit(None, SampleResult(torch.tensor([7]), 0), VerifyResult(torch.tensor([7]), None, hidden_states=rows))
    first = state.propose_request()
    assert (first.hidden_position, first.hidden_states.flatten().tolist()) == (0, [0.0, 1.0, 2.0])
    proposal = Proposal(torch.tensor([8, 9, 10]))
    verify = state.verify_request(proposal)  # [7, 8, 9, 10] at position 3
    fed = torch.arange(3.0, 7.0)[:, None]  # rows of positions 3 .. 6
    state.commit(proposal, SampleResult(torch.tensor([8, 11]), 1), VerifyResult(torch.tensor([8, 11, 0, 0]), None, hidden_states=fed))  # 8 accepted, 9 and 10 rejected
    second = state.propose_request()
    assert verify.position == 3 and second.position == 4 and second.token_ids == [8, 11]
    assert (second.hidden_position, second.hidden_states.flatten().tolist()) == (3, [3.0, 4.0])  # 7 and 8 stay
    with pytest.raises(ValueError, match=r"carries no hidden states, but the proposer reads layers \(1,\)"):
        state.commit(Proposal(torch.tensor([1])), SampleResult(torch.tensor([1, 2]), 1), None)


def test_a_request_that_never_drafts_asks_the_target_for_no_hidden_states():
    from specdec.engine import SequenceState
    from specdec.types import SampleResult, VerifyResult

    state = SequenceState("s", [4, 5, 6], GenerationParams(max_tokens=10, num_speculative_tokens=0), hidden_layers=(1,))
    assert state.verify_request(None).hidden_layers == ()
    state.commit(None, SampleResult(torch.tensor([7]), 0), VerifyResult(torch.tensor([7]), None))  # no rows: no error
    assert state.propose_request() is None and state.verify_request(None).hidden_layers == ()


def test_one_verify_call_serves_sequences_that_ask_for_hidden_states_beside_ones_that_do_not(pair):
    """A sequence that never drafts asks for no layers; the call's pass returns the others' all the same."""
    from specdec.types import VerifyRequest

    _, target_dir, _ = pair
    verifier, greedy, layers = TargetVerifier(FastCausalLM(target_dir, max_num_seqs=6)), SamplingParams(), (2, 3, 6)
    alone = verifier.verify([VerifyRequest("a", 0, PROMPTS[0], 1, greedy, hidden_layers=layers)])[0]
    mixed = verifier.verify([VerifyRequest("b", 0, PROMPTS[0], 1, greedy, hidden_layers=layers),
                             VerifyRequest("c", 0, PROMPTS[1], 1, greedy)])  # fmt: skip
    torch.testing.assert_close(mixed[0].hidden_states, alone.hidden_states)
    assert mixed[1].hidden_states.shape[0] == len(PROMPTS[1])  # returned, and left unread by its sequence
    assert torch.equal(mixed[1].argmax, verifier.verify([VerifyRequest("d", 0, PROMPTS[1], 1, greedy)])[0].argmax)
    with pytest.raises(ValueError, match="must ask for the same hidden_layers"):
        verifier.verify([VerifyRequest("e", 0, PROMPTS[0], 1, greedy, hidden_layers=layers),
                         VerifyRequest("f", 0, PROMPTS[1], 1, greedy, hidden_layers=(1,))])  # fmt: skip


def test_a_prompt_beside_decoding_rows_runs_in_a_pass_of_its_own_with_the_same_drafts(pair, monkeypatch):
    """A prompt's catch-up rows would pad every decoding row of its batch to its length; split as
    the target's passes are, each sequence drafts what it drafts alone."""
    _, target_dir, head_dir = pair
    lm = FastCausalLM(target_dir, max_num_seqs=3)
    head = load_eagle3(head_dir, target_dir, torch.float32, "cpu")
    prompts = {"long": [1 + i % (VOCAB - 1) for i in range(60)], "a": PROMPTS[0], "b": PROMPTS[2]}
    calls = [ForwardCall(s, 0, t[:-1], 1) for s, t in prompts.items()]
    hidden = dict(zip(prompts, lm.forward_with_hidden(calls, head.config.aux_layers)[1]))
    sampling = SamplingParams(temperature=1.0)

    def propose(seq_ids: list[str]) -> tuple[dict[str, list[int]], list[tuple[int, int]]]:
        proposer = build_head_proposer("eagle3", head_dir, target_dir, max_num_seqs=3)
        shapes = []
        forward = proposer._forward
        monkeypatch.setattr(proposer, "_forward", lambda ids, *rest: shapes.append((len(ids), max(map(len, rest[1]))))
                            or forward(ids, *rest))  # fmt: skip
        requests = [ProposeRequest(s, 0, prompts[s], 3, sampling, list(prompts).index(s), hidden_states=hidden[s])
                    for s in seq_ids]  # fmt: skip
        return {s: p.token_ids.tolist() for s, p in zip(seq_ids, proposer.propose(requests))}, shapes

    together, shapes = propose(["long", "a", "b"])
    assert shapes[:2] == [(2, len(prompts["b"]) - 1), (1, len(prompts["long"]) - 1)]  # shortest first, then the prompt
    for seq_id in prompts:
        alone, _ = propose([seq_id])
        assert together[seq_id] == alone[seq_id]
