"""The fast engine with its forward compiled for CPU (``specdec.fast.cpu_compile``) against the eager engine and HF.

Compiling costs seconds per model, so one compiled target and one compiled draft serve
the whole module; the draft has the target's shape, so its graphs come from the same
compile (inductor's on-disk cache).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdec.build import build_lm
from specdec.engine import GenerationParams
from specdec.generate import generate
from specdec.fast import FastCausalLM, ForwardCall
from specdec.fast import cpu_compile
from specdec.proposers.draft_model import DraftModelProposer
from specdec.rejection_sampler import RejectionSampler
from specdec.verifier import TargetVerifier
from test_fast_llama import random_ids, save_checkpoint
from test_fast_verifier import hf_greedy

ATOL = 1e-4
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path, hf = save_checkpoint(tmp_path_factory.mktemp("target"), "llama", seed=0)  # GQA: 4 query, 2 kv heads
    compiled = FastCausalLM(path, dtype="float32", max_num_seqs=2, max_model_len=MAX_MODEL_LEN, cpu_compile=True)
    eager = FastCausalLM(path, dtype="float32", max_num_seqs=2, max_model_len=MAX_MODEL_LEN)
    return path, hf, compiled, eager


def test_warm_up_gives_every_slot_back(target):
    _, _, compiled, _ = target
    assert compiled.num_active_sequences == 0 and compiled.cache.num_free == 2
    assert compiled.cached_length(f"{cpu_compile.WARM_UP_SEQ_ID}-0") == 0


def test_compiled_logits_equal_eager_through_prefill_decode_verify_batch_and_rollback(target):
    _, _, compiled, eager = target
    prompt_a, prompt_b = random_ids(20, 11), random_ids(7, 12)
    steps = [
        [ForwardCall("a", 0, prompt_a, 1)],  # prefill
        [ForwardCall("a", 20, [3], 1)],  # decode
        [ForwardCall("a", 21, [4, 5, 6, 7], 4)],  # verify
        [ForwardCall("a", 23, [8, 9], 2), ForwardCall("b", 0, prompt_b, 3)],  # rollback beside a prefill
        [ForwardCall("a", 25, [1], 1), ForwardCall("b", 7, [2, 3, 4], 3)],  # a ragged batch
    ]
    try:
        for calls in steps:
            for got, want in zip(compiled.forward(calls), eager.forward(calls)):
                assert got.shape == want.shape
                torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
        assert compiled.cached_length("a") == eager.cached_length("a") == 26
    finally:
        for lm in (compiled, eager):
            lm.release("a"), lm.release("b")


def test_compiled_pair_greedy_equals_hf_generate(target, tmp_path):
    path, hf, compiled_target, _ = target
    draft_path, _ = save_checkpoint(tmp_path / "draft", "llama", seed=1)  # the target's shape, other weights
    draft = FastCausalLM(draft_path, dtype="float32", max_num_seqs=1, max_model_len=MAX_MODEL_LEN, cpu_compile=True)
    proposer, verifier = DraftModelProposer(draft), TargetVerifier(compiled_target)
    prompt = random_ids(6, 26)
    params = GenerationParams(max_tokens=16, num_speculative_tokens=3)
    out = [t for step in generate(proposer, verifier, RejectionSampler(), prompt, params) for t in step.new_token_ids]
    assert out == hf_greedy(hf, prompt, 16)
    assert proposer.num_active_sequences == 0 and verifier.num_active_sequences == 0


def test_a_compiled_qwen3_pair_greedy_equals_hf_generate(tmp_path):
    """Qwen3's per-head query and key norms, compiled: the same greedy output as transformers'."""
    path, hf = save_checkpoint(tmp_path / "target", "qwen3-tied", seed=0)
    draft_path, _ = save_checkpoint(tmp_path / "draft", "qwen3-tied", seed=1)
    lms = [FastCausalLM(p, dtype="float32", max_num_seqs=1, max_model_len=MAX_MODEL_LEN, cpu_compile=True)
           for p in (path, draft_path)]  # fmt: skip
    proposer, verifier = DraftModelProposer(lms[1]), TargetVerifier(lms[0])
    prompt = random_ids(6, 27)
    params = GenerationParams(max_tokens=16, num_speculative_tokens=3)
    out = [t for step in generate(proposer, verifier, RejectionSampler(), prompt, params) for t in step.new_token_ids]
    assert out == hf_greedy(hf, prompt, 16)


def test_cpu_compile_is_refused_where_it_cannot_apply(target):
    path = target[0]
    with pytest.raises(ValueError, match="cpu_compile is for CPU"):
        FastCausalLM(path, dtype="float32", device="meta", max_num_seqs=1, max_model_len=MAX_MODEL_LEN, cpu_compile=True)
    with pytest.raises(ValueError, match="cpu_compile needs engine 'fast'"):
        build_lm(path, "hf", cpu_compile=True)


def test_build_lm_compiles_only_on_cpu(target, monkeypatch):
    """One configuration serves on CPU and GPU: on a GPU the flag is dropped, CUDA graphs apply instead."""
    seen = {}
    monkeypatch.setattr("specdec.build.FastCausalLM", lambda *args, **kwargs: seen.update(kwargs))
    build_lm(target[0], "fast", "float32", "cuda", max_num_seqs=1, cpu_compile=True)
    assert seen["cpu_compile"] is False
    build_lm(target[0], "fast", "float32", "cpu", max_num_seqs=1, cpu_compile=True)
    assert seen["cpu_compile"] is True


def test_a_missing_compiler_is_named(monkeypatch):
    monkeypatch.setattr(cpu_compile.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="cpu_compile needs a C\\+\\+ compiler on PATH .*set cpu_compile false"):
        cpu_compile.check_compiler()


def test_a_locale_without_utf8_is_switched_or_named(monkeypatch):
    """A Triton stub starts in the C locale, where inductor's templates do not decode."""
    monkeypatch.setattr(cpu_compile.locale, "getpreferredencoding", lambda do_setlocale=True: "ANSI_X3.4-1968")
    switched = []
    monkeypatch.setattr(cpu_compile.locale, "setlocale", lambda category, name: switched.append(name))
    cpu_compile.use_utf8_text_files()
    assert switched == ["C.UTF-8"]

    def missing(category, name):
        raise cpu_compile.locale.Error("unsupported locale setting")

    monkeypatch.setattr(cpu_compile.locale, "setlocale", missing)
    with pytest.raises(RuntimeError, match="cpu_compile needs a UTF-8 locale"):
        cpu_compile.use_utf8_text_files()


def test_compiled_packed_linears_equal_eager(tmp_path, monkeypatch):
    """Every linear packed for oneDNN (as the shipped models' are) and called from the compiled graph."""
    monkeypatch.setattr("specdec.fast.cpu_linear.PACK_MIN_ELEMENTS", 0)  # the test model's weights are tiny
    path, _ = save_checkpoint(tmp_path, "llama", seed=3)
    compiled = FastCausalLM(path, dtype="float32", max_num_seqs=2, max_model_len=MAX_MODEL_LEN, cpu_compile=True)
    eager = FastCausalLM(path, dtype="float32", max_num_seqs=2, max_model_len=MAX_MODEL_LEN)
    assert all(type(layer.mlp.down_proj).__name__ == "PackedLinear" for layer in compiled.model.model.layers)
    prompt = random_ids(12, 5)
    for calls in ([ForwardCall("a", 0, prompt, 1)], [ForwardCall("a", 12, [3], 1)], [ForwardCall("a", 13, [4, 5], 2)],
                  [ForwardCall("a", 15, [6, 7, 8, 9, 1], 5)]):  # fmt: skip
        for got, want in zip(compiled.forward(calls), eager.forward(calls)):
            torch.testing.assert_close(got, want, atol=ATOL, rtol=0)


def test_a_heads_first_pass_compiles_every_hidden_state_shape_at_once(target):
    """The layers a head reads arrive with its first verify: that pass compiles them all, later ones none.

    On another thread than the load's, as a served model's socket thread: torch's config
    overrides (the recompile limit) are per thread, and these graphs come on top of the load's.
    """
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(max_workers=1) as worker:
        worker.submit(_hidden_state_passes, target).result()


def _hidden_state_passes(target):
    from torch._dynamo.utils import counters

    _, _, compiled, eager = target
    layers = (1, 2)
    steps = [
        [ForwardCall("a", 0, random_ids(20, 13), 1)],  # prefill: the warm-up for these layers runs first
        [ForwardCall("a", 20, [3], 1)],
        [ForwardCall("a", 21, [4, 5, 6, 7, 8], 5), ForwardCall("b", 0, random_ids(9, 14), 1)],
        [ForwardCall("a", 24, [1, 2], 2), ForwardCall("b", 9, [2], 1)],
    ]
    try:
        compiles = []
        for calls in steps:
            before = counters["aot_autograd"]["total"]
            got, want = compiled.forward_with_hidden(calls, layers), eager.forward_with_hidden(calls, layers)
            compiles.append(counters["aot_autograd"]["total"] - before)
            for g, w in zip(got[0] + got[1], want[0] + want[1]):
                torch.testing.assert_close(g, w, atol=ATOL, rtol=0)
        assert compiles[0] > 0 and compiles[1:] == [0] * (len(steps) - 1), compiles
        assert layers in compiled._compiled_hidden and compiled.num_active_sequences == 2  # warm-up slots given back
    finally:
        for lm in (compiled, eager):
            lm.release("a"), lm.release("b")


def test_a_warm_tree_load_compiles_tree_passes_before_any_request(target):
    """With warm_trees, a tree pass after the load compiles nothing new: its graphs were built by warm_up.
    The module's target and sizes: its other graphs are the compiled fixture's, found in the compile cache."""
    import torch._dynamo

    lm = FastCausalLM(target[0], dtype="float32", max_num_seqs=2, max_model_len=MAX_MODEL_LEN, cpu_compile=True,
                      warm_trees=True)  # fmt: skip
    counters = torch._dynamo.utils.counters
    before = counters["stats"]["unique_graphs"]
    lm.forward([ForwardCall("s", 0, list(range(20)), 1)])
    lm.forward([ForwardCall("s", 20, [5, 6, 7, 8], 4, (-1, -1, 0))])
    assert counters["stats"]["unique_graphs"] == before
