"""Fixed-shape (CUDA-graph) passes give the eager pass's logits.

On CPU the fixed-shape runner runs without capture, which checks the bucket padding,
the persistent buffers and the scratch slot; the capture itself needs CUDA.
"""
from __future__ import annotations

import pytest
import torch

from specdec.engine import GenerationParams
from specdec.generate import generate
from specdec.fast import FastCausalLM, ForwardCall
from specdec.fast.cuda_graphs import StaticShapeRunner, batch_buckets
from specdec.proposers import DraftModelProposer
from specdec.rejection_sampler import RejectionSampler
from specdec.types import ProposeRequest, SamplingParams, VerifyRequest
from specdec.verifier import TargetVerifier
from test_fast_llama import random_ids, save_checkpoint
from test_fast_verifier import hf_greedy

ATOL = 1e-4


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("llama"), seed=30)


def test_batch_buckets():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(8) == (1, 2, 4, 8)


def ragged_steps() -> list[list[ForwardCall]]:
    a, b, c, d = (random_ids(20, seed) for seed in (31, 32, 33, 34))
    return [
        [ForwardCall("a", 0, a[:6], 1), ForwardCall("b", 0, b[:3], 1), ForwardCall("d", 0, d[:2], 2)],  # eager
        [ForwardCall("a", 6, a[6:9], 3), ForwardCall("b", 3, b[3:4], 1), ForwardCall("c", 0, c[:2], 2),
         ForwardCall("d", 2, d[2:3], 1)],
        # 3 rows in the 4-row bucket: the unused row must not write into d's slot. a rolls back from 9 to 7.
        [ForwardCall("a", 7, a[7:8], 1), ForwardCall("c", 2, c[2:6], 4), ForwardCall("b", 4, b[4:5], 1)],
        [ForwardCall("d", 3, d[3:5], 2), ForwardCall("b", 2, b[2:5], 2)],
    ]


def run_steps(lm: FastCausalLM) -> list[torch.Tensor]:
    return [logits for step in ragged_steps() for logits in lm.forward(step)]


def test_static_shape_runner_matches_eager_on_cpu(llama):
    path, _ = llama
    eager = FastCausalLM(path, dtype="float32", max_num_seqs=4, max_model_len=32)
    static = FastCausalLM(path, dtype="float32", max_num_seqs=4, max_model_len=32)
    static.graphs = StaticShapeRunner(static.model, static.cache, (1, 2, 4))
    assert static.graphs.bucket(3, 3) == (4, 4) and static.graphs.bucket(1, 5) is None
    for got, want in zip(run_steps(static), run_steps(eager)):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    scratch = static.cache.kv[:, :, static.cache.scratch_slot]
    assert scratch.abs().sum() > 0  # padding was written, and only there: the results above are unaffected


def run_steps_with_hidden(lm: FastCausalLM, layers: tuple[int, ...]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    out = []
    for step in ragged_steps():
        logits, hidden = lm.forward_with_hidden(step, layers)
        out += list(zip(logits, hidden))
    return out


def test_static_shape_runner_with_hidden_states_matches_eager_on_cpu(llama):
    """A head's verify passes run at fixed shapes too: the hidden states come out of the bucket's rows."""
    path, _ = llama
    eager = FastCausalLM(path, dtype="float32", max_num_seqs=4, max_model_len=32)
    static = FastCausalLM(path, dtype="float32", max_num_seqs=4, max_model_len=32)
    static.graphs = StaticShapeRunner(static.model, static.cache, (1, 2, 4))
    layers = (0, 1, static.model.config.num_layers)
    got, want = run_steps_with_hidden(static, layers), run_steps_with_hidden(eager, layers)
    assert set(static._graphs_with_hidden) == {layers}  # made on the first pass that asked, then kept
    for (g_logits, g_hidden), (w_logits, w_hidden) in zip(got, want):
        torch.testing.assert_close(g_logits, w_logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(g_hidden, w_hidden, atol=ATOL, rtol=0)


def cuda_test(fn):
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")(fn))


@cuda_test
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_cuda_graph_verifier_matches_eager(llama, dtype):
    path, _ = llama
    kwargs = dict(dtype=dtype, device="cuda", max_num_seqs=4, max_model_len=64)
    graphed = TargetVerifier(FastCausalLM(path, cuda_graphs=True, **kwargs))
    eager = TargetVerifier(FastCausalLM(path, cuda_graphs=False, **kwargs))
    assert graphed.lm.graphs is not None and eager.lm.graphs is None
    sampled = SamplingParams(temperature=0.7)
    for step in ragged_steps():
        requests = [VerifyRequest(c.seq_id, c.position, c.token_ids, c.num_logits, sampled) for c in step]
        for g, e in zip(graphed.verify(requests), eager.verify(requests)):
            if dtype == "float32":
                assert torch.equal(g.argmax, e.argmax)
            torch.testing.assert_close(g.probs, e.probs, atol=ATOL if dtype == "float32" else 2e-2, rtol=0)


@cuda_test
def test_cuda_graph_draft_matches_eager(llama):
    path, _ = llama
    kwargs = dict(dtype="float32", device="cuda", max_num_seqs=2, max_model_len=64)
    graphed = DraftModelProposer(FastCausalLM(path, cuda_graphs=True, **kwargs))
    eager = DraftModelProposer(FastCausalLM(path, cuda_graphs=False, **kwargs))
    ids = {"a": random_ids(9, 35), "b": random_ids(3, 36)}
    for sampling in (SamplingParams(), SamplingParams(temperature=1.0)):
        requests = [ProposeRequest(s, 0, t, 4, sampling, seed=i) for i, (s, t) in enumerate(ids.items())]
        for g, e in zip(graphed.propose(requests), eager.propose(requests)):
            assert torch.equal(g.token_ids, e.token_ids)
            if sampling.greedy:
                assert g.probs is None and e.probs is None
            else:
                torch.testing.assert_close(g.probs, e.probs, atol=ATOL, rtol=0)


@cuda_test
def test_cuda_graph_with_hidden_states_matches_eager(llama):
    path, _ = llama
    kwargs = dict(dtype="float32", device="cuda", max_num_seqs=4, max_model_len=64)
    graphed = FastCausalLM(path, cuda_graphs=True, **kwargs)
    eager = FastCausalLM(path, cuda_graphs=False, **kwargs)
    layers = (1, graphed.model.config.num_layers)
    got, want = run_steps_with_hidden(graphed, layers), run_steps_with_hidden(eager, layers)
    assert layers in graphed._graphs_with_hidden
    for (g_logits, g_hidden), (w_logits, w_hidden) in zip(got, want):
        torch.testing.assert_close(g_logits, w_logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(g_hidden, w_hidden, atol=ATOL, rtol=0)


@cuda_test
def test_cuda_graph_qwen3_pair_greedy_equals_hf_generate(tmp_path):
    """Qwen3's per-head query and key norms inside captured graphs and the slot attention kernel."""
    path, hf = save_checkpoint(tmp_path / "target", "qwen3-tied", seed=0)
    draft_path, _ = save_checkpoint(tmp_path / "draft", "qwen3-tied", seed=1)
    kwargs = dict(dtype="float32", device="cuda", max_num_seqs=1, max_model_len=64, cuda_graphs=True)
    target, draft = FastCausalLM(path, **kwargs), FastCausalLM(draft_path, **kwargs)
    assert target.graphs is not None and draft.graphs is not None
    prompt = random_ids(6, 27)
    params = GenerationParams(max_tokens=16, num_speculative_tokens=3)
    steps = generate(DraftModelProposer(draft), TargetVerifier(target), RejectionSampler(), prompt, params)
    assert [t for step in steps for t in step.new_token_ids] == hf_greedy(hf, prompt, 16)


@cuda_test
def test_eager_attention_on_cuda_leaves_cudnn_out(llama):
    """cuDNN's SDPA builds a plan per new shape, and eager passes change shape every step."""
    path, _ = llama
    lm = FastCausalLM(path, dtype="bfloat16", device="cuda", max_num_seqs=4, max_model_len=64, cuda_graphs=False)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        run_steps(lm)
        torch.cuda.synchronize()
    kernels = [event.key for event in prof.key_averages()]
    assert kernels and not [k for k in kernels if "cudnn" in k.lower()], kernels
