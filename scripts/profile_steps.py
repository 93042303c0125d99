"""Where the engine's time goes, by call: each propose and verify of one configuration, timed apart.

    python scripts/profile_steps.py --target DIR --eagle3 DIR --method eagle3 --k 4 --concurrency 4 \
        --device cuda --dtype bfloat16 --synthetic-acceptance-rate 0.7 [--profile-eager-head]

Runs ``--num-prompts`` random prompts through the step scheduler (as ``benchmark_engine.py``
does: CUDA graphs wherever the device has them, uncompiled on CPU) with every ``propose`` and ``verify``
wrapped: each call's wall time (the device synchronised before and after), its rows and its
widest row's new tokens. Calls with a row wider than ``--wide`` tokens (a prompt's prefill)
are reported apart from the steps, so a phase's time splits into prefills, verify steps and
proposals. ``--profile-eager-head`` adds ``torch.profiler``'s top operators of a head's
steady-state proposal without graphs.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from bench.bound import propose_ms, synchronize  # noqa: E402
from bench.engine import LocalStages, build_proposer, run_phase  # noqa: E402
from specdec.engine import GenerationParams  # noqa: E402
from specdec.fast import FastCausalLM  # noqa: E402
from specdec.fast.checkpoint import read_config  # noqa: E402
from specdec.heads import HEAD_METHODS  # noqa: E402
from specdec.rejection_sampler import RejectionSampler  # noqa: E402
from specdec.verifier import TargetVerifier  # noqa: E402


class CallTimes:
    """Wall time of each call of ``obj.<name>``, keyed by (name, prefill or step, rows)."""

    def __init__(self, device: torch.device, wide: int):
        self.device, self.wide = device, wide
        self.ms: dict[tuple[str, str, int], list[float]] = defaultdict(list)

    def wrap(self, obj, name: str) -> None:
        call = getattr(obj, name)

        def timed(requests):
            kind = "prefill" if max(len(r.token_ids) for r in requests) > self.wide else "step"
            synchronize(self.device)
            start = time.perf_counter()
            out = call(requests)
            synchronize(self.device)
            self.ms[(name, kind, len(requests))].append(1e3 * (time.perf_counter() - start))
            return out

        setattr(obj, name, timed)

    def report(self, wall_s: float) -> None:
        total = sum(sum(v) for v in self.ms.values())
        print(f"phase wall {1e3 * wall_s:.1f} ms, in timed calls {total:.1f} ms "
              f"({100 * total / (1e3 * wall_s):.0f} %)")  # fmt: skip
        print("| call | kind | rows | calls | median ms | total ms | share of wall |")
        print("|---|---|---|---|---|---|---|")
        for (name, kind, rows), ms in sorted(self.ms.items()):
            print(f"| {name} | {kind} | {rows} | {len(ms)} | {statistics.median(ms):.2f} | {sum(ms):.1f} | "
                  f"{100 * sum(ms) / (1e3 * wall_s):.0f} % |")  # fmt: skip


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--draft", type=Path, help="--method draft_model: the draft checkpoint")
    p.add_argument("--eagle3", type=Path)
    p.add_argument("--mlp-speculator", type=Path)
    p.add_argument("--method", default="eagle3", choices=("k0", "draft_model", *HEAD_METHODS))
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--synthetic-acceptance-rate", type=float, default=None)
    p.add_argument("--wide", type=int, default=16, help="a call with a row of more new tokens counts as a prefill")
    p.add_argument("--profile-eager-head", action="store_true")
    return p.parse_args()


def profile_eager_head(args, max_model_len: int) -> None:
    """``torch.profiler``'s top operators over a few steady-state proposals of the head without graphs."""
    proposer = build_proposer(args.method, args, 1, max_model_len, cuda_graphs=False)
    width = len(proposer.hidden_state_layers) * read_config(args.target).hidden_size
    print(f"eager head, {args.k}-draft proposal: "
          f"{propose_ms(proposer, width, proposer.vocab_size, args.prompt_tokens, [args.k], 10)[args.k]:.2f} ms")
    with torch.profiler.profile() as prof:
        propose_ms(proposer, width, proposer.vocab_size, args.prompt_tokens, [args.k], repeats=3, warmup=1)
    sort = "self_device_time_total" if args.device != "cpu" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=15, max_name_column_width=60))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=15, max_name_column_width=60))


@torch.inference_mode()
def main() -> None:
    args = parse_args()
    max_model_len = args.prompt_tokens + args.max_tokens + args.k + 8
    gen = torch.Generator().manual_seed(0)
    vocab = read_config(args.target).vocab_size
    prompts = [torch.randint(0, vocab, (args.prompt_tokens,), generator=gen).tolist() for _ in range(args.num_prompts)]
    lm = FastCausalLM(args.target, args.dtype, args.device, args.concurrency, max_model_len)
    verifier = TargetVerifier(lm)
    proposer = None if args.method == "k0" else build_proposer(args.method, args, args.concurrency, max_model_len, None)
    k = 0 if proposer is None else args.k
    rule = ("synthetic", args.synthetic_acceptance_rate) if args.synthetic_acceptance_rate is not None else ("strict", 0.0)
    params = GenerationParams(max_tokens=args.max_tokens, min_tokens=args.max_tokens, num_speculative_tokens=k)
    layers = getattr(proposer, "hidden_state_layers", ())
    stages = LocalStages(verifier, RejectionSampler(*rule), proposer)
    run_phase(stages, prompts[:2], params, args.concurrency, layers, False, name="warm")
    times = CallTimes(torch.device(args.device), args.wide)
    times.wrap(verifier, "verify")
    if proposer is not None:
        times.wrap(proposer, "propose")
    start = time.perf_counter()
    result = run_phase(stages, prompts, params, args.concurrency, layers, False, name="profiled")
    wall = time.perf_counter() - start
    tokens = sum(len(o) for o in result.outputs)
    print(f"{args.method} k={k} c={args.concurrency} on {args.device}: {tokens} tokens, {tokens / wall:.1f} tokens/s")
    times.report(wall)
    if args.profile_eager_head and args.method in HEAD_METHODS:
        profile_eager_head(args, max_model_len)


if __name__ == "__main__":
    main()
