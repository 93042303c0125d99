"""The Triton rejection kernel emits exactly the torch path's tokens, given the same random draws.

On CPU the kernel runs under ``TRITON_INTERPRET=1``, which ``triton.jit`` reads when the
kernel module is imported; so the comparison runs in a subprocess (this file as a script)
and leaves the test process, and every other test in it, untouched. On CUDA the compiled
kernel is compared in process.
"""
import itertools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from specdec.rejection_sampler import METHODS, RejectionSampler, draw_randoms, rejection_sample_batch
from specdec.types import PLACEHOLDER_TOKEN_ID, VerifyResult

REPO_ROOT = Path(__file__).resolve().parents[1]
BATCH = 8
# (vocab, block): one block; several blocks with a ragged tail; two default blocks. None a power of two.
VOCAB_BLOCKS = [(7, 1024), (300, 64), (1500, 1024)]
OPERANDS = ["p_q", "p_one_hot_q", "greedy"]  # which of target_probs / draft_probs are given
CASES = {
    f"{method}-k{k}-v{vocab}-{operands}": (method, k, vocab, block, operands)
    for method, k, (vocab, block), operands in itertools.product(METHODS, [0, 1, 4], VOCAB_BLOCKS, OPERANDS)
}


def random_probs(generator: torch.Generator, *shape: int, sparse: bool) -> torch.Tensor:
    weights = torch.rand(*shape, generator=generator) ** 3  # [..., vocab]
    if sparse:
        weights = weights * (torch.rand(*shape, generator=generator) > 0.5)
        weights[..., -1] += 0.01  # no row is all zero
    return weights / weights.sum(dim=-1, keepdim=True)


def case_inputs(seed: int, method: str, k: int, vocab: int, operands: str, device: str) -> tuple:
    """Positional arguments of the batch samplers: drafts, q, p, argmax, method, randoms, rate."""
    generator = torch.Generator().manual_seed(seed)
    q = random_probs(generator, BATCH, k, vocab, sparse=seed % 2 == 1)  # [batch, k, vocab]
    p = random_probs(generator, BATCH, k + 1, vocab, sparse=seed % 2 == 1)  # [batch, k + 1, vocab]
    drafts = torch.randint(0, vocab, (BATCH, k), generator=generator)  # [batch, k]
    if k:
        drafts[0] = p[0, :k].argmax(dim=-1)  # likely accepted: reaches the later positions and the bonus
    randoms = draw_randoms(BATCH, k, vocab, generator, categorical=operands != "greedy", device=device)
    return (
        drafts.to(device),
        q.to(device) if operands == "p_q" else None,
        p.to(device) if operands != "greedy" else None,
        p.argmax(dim=-1).to(device),
        method,
        randoms,
        0.6,
    )


def compare(kernel_outputs: tuple, torch_outputs: tuple) -> str:
    """An empty string when both paths emitted the same tokens, else both results."""
    same = all(torch.equal(a.cpu(), b.cpu()) for a, b in zip(kernel_outputs, torch_outputs))
    return "" if same else f"kernel {[t.tolist() for t in kernel_outputs]} != torch {[t.tolist() for t in torch_outputs]}"


def run_cases(device: str) -> dict[str, str]:
    """Mismatch report per case id (empty string: identical), including the sampler class and the
    all-zero residual fallback."""
    from specdec.kernels.rejection import rejection_sample_triton

    report = {}
    for seed, (case_id, (method, k, vocab, block, operands)) in enumerate(CASES.items()):
        inputs = case_inputs(seed, method, k, vocab, operands, device)
        report[case_id] = compare(rejection_sample_triton(*inputs, block=block), rejection_sample_batch(*inputs))

    # q = 2p, unnormalized: rejections happen while max(0, p - q) is all zero, so both fall back to p.
    drafts, _, p, argmax, _, randoms, _ = case_inputs(0, "probabilistic", 4, 50, "p_q", device)
    inputs = (drafts, 2 * p[:, :-1], p, argmax, "probabilistic", randoms)
    report["zero-residual-fallback"] = compare(rejection_sample_triton(*inputs), rejection_sample_batch(*inputs))

    # Ragged rows: drafts padded with PLACEHOLDER_TOKEN_ID (-1), which the kernel must not read as an id.
    for method, operands in itertools.product(METHODS, OPERANDS):
        drafts, q, p, argmax, _, randoms, rate = case_inputs(7, method, 4, 300, operands, device)
        drafts[1:, 2:] = PLACEHOLDER_TOKEN_ID
        drafts[2, 0:] = PLACEHOLDER_TOKEN_ID
        inputs = (drafts, q, p, argmax, method, randoms, rate)
        report[f"placeholder-drafts-{method}-{operands}"] = compare(
            rejection_sample_triton(*inputs), rejection_sample_batch(*inputs))

    drafts, q, p, argmax, _, _, _ = case_inputs(1, "probabilistic", 4, 300, "p_q", device)
    for method in METHODS:
        torch_sampler = RejectionSampler(method, synthetic_acceptance_rate=0.5)
        kernel_sampler = RejectionSampler(method, synthetic_acceptance_rate=0.5, use_triton_kernel=True)
        verify = VerifyResult(argmax=argmax[0], probs=p[0])
        report[f"sampler-class-{method}"] = "".join(
            compare(
                (kernel_sampler(drafts[0], q[0], verify, seed).output_token_ids,),
                (torch_sampler(drafts[0], q[0], verify, seed).output_token_ids,),
            )
            for seed in range(5)
        )
    return report


@pytest.fixture(scope="module")
def interpreted_report() -> dict[str, str]:
    pytest.importorskip("triton")
    env = {
        **os.environ,
        "TRITON_INTERPRET": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    process = subprocess.run(
        [sys.executable, __file__], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300
    )
    assert process.returncode == 0, process.stderr[-4000:]
    return json.loads(process.stdout.strip().splitlines()[-1])


PLACEHOLDER_CASES = [f"placeholder-drafts-{m}-{o}" for m, o in itertools.product(METHODS, OPERANDS)]


@pytest.mark.parametrize(
    "case_id", [*CASES, "zero-residual-fallback", *PLACEHOLDER_CASES, *(f"sampler-class-{m}" for m in METHODS)]
)
def test_interpreted_kernel_matches_torch(interpreted_report, case_id):
    assert interpreted_report[case_id] == ""


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_kernel_matches_torch_on_cuda():
    report = run_cases("cuda")
    assert {case_id: message for case_id, message in report.items() if message} == {}


if __name__ == "__main__":
    print(json.dumps(run_cases("cpu")))
