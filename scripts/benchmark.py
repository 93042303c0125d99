#!/usr/bin/env python3
"""Benchmark speculative decoding served by Triton against plain decoding and Hugging Face.

Compared in one run, on the same checkpoints and held-out prompts:

* per proposer method, one server (a copy of the model repository with that method),
  and on it: ``num_speculative_tokens = 0`` per request (``k=0 (<method> server)``, the
  baseline of that server), each fixed k of ``--ks`` per request (``<method> k=K``), and,
  on the server of the repository's own method, requests that send no
  ``num_speculative_tokens`` (``default``: the configuration as shipped); a suffix
  server keeps no global tree, since the phases repeat the same prompts
  (``scripts/benchmark_repeat.py`` measures what the tree gains on repeated work);
* in-process ``generate``, one request at a time: plain (``hf plain``), with
  ``assistant_model`` (same draft, same k) and with ``prompt_lookup_num_tokens = k``.

Figures per configuration and concurrency: tokens/s (aggregate and per stream), the
ratios against the same server's k = 0 and against HF plain, TTFT, ITL p50/p99,
acceptance (overall and per draft position), tokens per verify step, per-step
orchestration overhead, and at one stream the analytic speedup bound and the efficiency
against it (``bench/``). In this process it also times the target's steps against their
memory-bandwidth floor and, on CUDA, the captured CUDA graphs against eager.

Writes the run as JSON to ``--out-dir`` (``benchmarks/results/<UTC date-time>-<commit>.json``;
schema in ``bench/report.py``) and prints the markdown tables; it edits no docs. Plot it
with ``scripts/plot_benchmarks.py``. With ``--rounds N`` the server phases run N times in
turn (every concurrency and k, then again) and each row pools all N; the tokens/s of each
round are kept in the row as ``tokens_per_s_rounds``.

    python scripts/benchmark.py --concurrency 1,4,8 --num-prompts 16 --max-tokens 64 --rounds 2
    python scripts/benchmark.py --target models/random-1b --draft models/random-125m --synthetic-acceptance-rate 0.8
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import transformers

from bench import report
from bench.client import Job
from bench.engine_configs import GUIDED, read_guide
from bench.hf import generation_config, run_hf
from bench.phase import (
    ORCHESTRATOR,
    PROPOSER_MODEL,
    SAMPLER_MODEL,
    TARGET_MODEL,
    PhaseMeasurement,
    Progress,
    measure_phase,
    phase_row,
    warm_up,
)
from bench.repository import (
    BESIDE_SUFFIX, checkpoint_edits, get_parameters, make_variant, method_of, suffix_first, variant_edits,
)  # fmt: skip
from bench.results import (
    DEFAULT_NAME, DEFAULT_SERVER, HF_PLAIN, annotate, fixed_name, k0_name,
    match_reference,
)  # fmt: skip
from bench.server import SERVE_SCRIPT, TritonServer
from bench.speculation_table import read_table, servers_in
from bench.step_times import in_process_timings, server_parameter
from bench.stats import latency_summary
from bench.workload import held_out_texts, select_prompts
from specdec.models import load_causal_lm
from specdec.tokenizer import eos_token_ids, load_tokenizer
from specdec.proposers import PROPOSERS
from specdec.proposers.model_free import MODEL_FREE_METHODS

REPO_ROOT = Path(__file__).resolve().parent.parent
Outputs = dict[tuple[str, int], list[str]]  # (config, concurrency) -> output texts in prompt order


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", type=Path, default=REPO_ROOT / "models" / "tiny-target")
    p.add_argument("--draft", type=Path, default=REPO_ROOT / "models" / "tiny-draft")
    p.add_argument("--eagle3", type=Path, default=REPO_ROOT / "models" / "tiny-eagle3",
                   help="the EAGLE-3 head the eagle3 servers load (draft_model of method eagle3)")
    p.add_argument("--mlp-speculator", type=Path, default=REPO_ROOT / "models" / "tiny-mlp-speculator",
                   help="the MLP speculator the mlp_speculator servers load")
    p.add_argument("--medusa", type=Path, default=REPO_ROOT / "models" / "tiny-medusa",
                   help="the Medusa heads the medusa servers load")
    p.add_argument("--dflash", type=Path, default=REPO_ROOT / "models" / "tiny-dflash",
                   help="the DFlash drafter the dflash servers load")
    p.add_argument("--repository", type=Path, default=REPO_ROOT / "model_repository")
    p.add_argument("--methods", default="suffix,draft_model,ngram",
                   help="draft_proposer methods, comma-separated, each on a server of its own with its own k = 0; "
                        "METHOD+beside (a model method): run_with_target, the draft in target_verifier's process, one "
                        "call a step; METHOD+suffix (draft_model or a head, before any +beside): suffix decoding in "
                        "front of the model (enable_suffix_decoding)")
    p.add_argument("--ks", type=int_list, default=[1, 2, 4], help="num_speculative_tokens values")
    p.add_argument("--model-k", type=int, default=0,
                   help="METHOD+suffix servers: model_num_speculative_tokens, the model's drafts (0: each k)")
    p.add_argument("--suffix-min-score", type=float, default=None,
                   help="METHOD+suffix servers: suffix_decoding_min_score (default: the model's, 2.0)")
    p.add_argument("--concurrency", type=int_list, default=[1, 4, 8, 16])
    p.add_argument("--num-prompts", type=int, default=16, help="requests per configuration and concurrency")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the server phases this many times in turn and pool them (against drift)")
    p.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (whole lines, at least this)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="min_tokens = max_tokens, so every configuration emits the same number of tokens")
    p.add_argument("--synthetic-acceptance-rate", type=float, default=None,
                   help="use the synthetic rejection sampler (for random-weight models)")
    p.add_argument("--hf", action=argparse.BooleanOptionalAction, default=True, help="in-process HF baselines")
    p.add_argument("--json", action="store_true",
                   help="every configuration also under a JSON schema (CONFIG+json, against k = 0 under it and "
                        "itself unguided: x_unguided), in the same rounds; the grammar decides where outputs end")
    p.add_argument("--guide", type=Path, default=None, help="with --json: the JSON schema (default: a built-in one)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads here and OMP_NUM_THREADS of every server model process (serve.sh's default)")
    p.add_argument("--timing-repeats", type=int, default=20, help="forwards per step-time median")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results",
                   help="where the run's JSON goes, as <UTC date-time>-<short commit>.json")
    p.add_argument("--log-dir", type=Path, default=None, help="the servers' logs (default runs/<the JSON's name>/)")
    p.add_argument("--note", action="append", default=[], help="a line of context for the JSON (repeatable)")
    p.add_argument("--commit", default=None, help="the checkout's commit, recorded as given (default: git's)")
    args = p.parse_args()
    if any(k < 1 for k in args.ks) or any(c < 1 for c in args.concurrency) or min(args.threads, args.rounds) < 1:
        p.error("--ks, --concurrency, --threads and --rounds values must be >= 1")
    args.methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in args.methods if method_of(m) not in PROPOSERS
               or (suffix_first(m) or m.endswith(BESIDE_SUFFIX)) and method_of(m) in MODEL_FREE_METHODS]  # fmt: skip
    if unknown or not args.methods:
        p.error(f"--methods must name some of {sorted(PROPOSERS)} (a model method optionally "
                f"+suffix, +beside or both, in that order), got {args.methods}")
    return args


def hf_rows(args, prompts, target, draft, tokenizer, outputs: Outputs, progress: Progress) -> list[dict]:
    config = generation_config(args.max_tokens, eos_token_ids(tokenizer, args.target), args.ignore_eos)
    runs = [(HF_PLAIN, "plain", 0, None)]
    if args.synthetic_acceptance_rate is None:  # random weights accept nothing: assisted figures would mislead
        for k in args.ks:
            runs += [(f"hf assisted k={k}", "assisted", k, "draft_model"),
                     (f"hf prompt_lookup k={k}", "prompt_lookup", k, "ngram")]
    rows = []
    list(run_hf(target, prompts[:1], config, "plain"))  # warm-up
    for name, mode, k, proposer in runs:
        progress.phase(name)
        started = time.perf_counter()
        timings, texts = [], []
        for timing, output_ids in run_hf(target, prompts, config, mode, k, draft):
            timings.append(timing)
            # decoded as the server's detokenizer does (specdec_triton/text.py)
            texts.append(tokenizer.decode(output_ids, skip_special_tokens=True, clean_up_tokenization_spaces=False))
            progress.step()
        summary = latency_summary(timings, time.perf_counter() - started)
        outputs[(name, 1)] = texts
        # generate() streams one target pass per chunk; assisted passes start at the prompt
        per_pass = summary["tokens_per_chunk"] if k else math.nan
        rows.append({"config": name, "kind": f"hf_{mode}", "concurrency": 1, "k": k, "method": proposer,
                     "proposer": proposer, "server": None, "baseline": HF_PLAIN,
                     "tokens_per_step": per_pass, "mean_accepted_length": per_pass, **summary})  # fmt: skip
    return rows


def hf_plain_tokens_per_s(args, prompts, target, tokenizer) -> float:
    """In-process HF plain decoding of every prompt in turn: output tokens over wall time."""
    config = generation_config(args.max_tokens, eos_token_ids(tokenizer, args.target), args.ignore_eos)
    started = time.perf_counter()
    tokens = sum(timing.num_tokens for timing, _ in run_hf(target, prompts, config, "plain"))
    return tokens / (time.perf_counter() - started)


def shipped_configuration(repository: Path) -> dict:
    """What requests that send no ``num_speculative_tokens`` get from the repository as committed."""
    return {"method": server_parameter(repository, PROPOSER_MODEL, "method", "draft_model"),
            "num_speculative_tokens": int(server_parameter(repository, ORCHESTRATOR, "num_speculative_tokens", "4")),
            "orchestrator_parameters": get_parameters((repository / ORCHESTRATOR / "config.pbtxt").read_text())}


def server_edits(args, method: str, shipped_k: int, fixed: bool) -> dict[str, dict[str, str]]:
    """The repository as shipped but for the method, the checkpoints and a k large enough for ``--ks``.

    ``fixed``: every request drafts the k it sends every step, whatever the batch size and
    its acceptance (the shipped batch-size table and ``speculative_disable_by_batch_size``
    cleared, ``speculation_follows_acceptance`` false), so each ``k=K`` row measures that
    k; the ``default`` row has a server of its own, as shipped.
    """
    checkpoints = {"draft_model": args.draft, "eagle3": args.eagle3, "mlp_speculator": args.mlp_speculator,
                   "medusa": args.medusa, "dflash": args.dflash}
    edits = checkpoint_edits(args.target, method, checkpoints.get(method))
    edits[ORCHESTRATOR] = {}
    if fixed:
        edits[ORCHESTRATOR].update(num_speculative_tokens_per_batch_size="", speculative_disable_by_batch_size="0",
                                   speculation_follows_acceptance="false")  # fmt: skip
    if fixed and max(args.ks) > shipped_k:  # a request may ask for at most the configured k
        edits[ORCHESTRATOR]["num_speculative_tokens"] = str(max(args.ks))
    if method == "suffix":  # every phase sends the same prompts: a global tree would draft earlier phases' outputs
        edits[PROPOSER_MODEL]["suffix_decoding_max_cached_requests"] = "0"
    if args.synthetic_acceptance_rate is not None:
        edits[SAMPLER_MODEL] = {"rejection_sample_method": "synthetic",
                                "synthetic_acceptance_rate": str(args.synthetic_acceptance_rate)}
    return edits


def server_rows(
    args, server_name: str, method: str, shipped: dict, prompts, workdir: Path, outputs: Outputs, progress: Progress,
    hf_plain: Callable[[], float] | None = None,
) -> list[dict]:
    """One server: ``method`` at k = 0 and each fixed k of ``args.ks``, or (``server_name`` "default")
    the shipped configuration against k = 0 on the same server.

    ``hf_plain`` (tokens/s of in-process HF plain decoding over the prompts) is measured
    once per round, right after the round's one-stream phases while the server idles, so
    that each one-stream row has a paired HF figure from the same minutes.
    """
    fixed = server_name != DEFAULT_SERVER
    edits = variant_edits(server_name, server_edits(args, method, shipped["num_speculative_tokens"], fixed), args.model_k,
                          args.suffix_min_score)  # fmt: skip
    if suffix_first(server_name):  # as a suffix server: no global tree
        edits[PROPOSER_MODEL]["suffix_decoding_max_cached_requests"] = "0"
    repository = make_variant(args.repository, workdir / f"repo-{server_name}", edits)
    # (name, kind, k sent per request; None: none sent, the server's default)
    configs = [(k0_name(server_name), "k0", 0)]
    fixed_configs = [(fixed_name(server_name, k), "fixed", k) for k in args.ks]
    configs += fixed_configs if fixed else [(DEFAULT_NAME, "default", None)]
    guide = read_guide(args.guide) if args.json else None  # a JSON schema's text
    if args.json:  # each beside its unguided twin, in the same round
        configs = [c for name, kind, k in configs for c in ((name, kind, k), (name + GUIDED, kind, k))]
    env = {"OMP_NUM_THREADS": str(args.threads)}  # each model process gets what this process uses
    phases: dict[tuple[str, int], PhaseMeasurement] = {}  # (config, concurrency), in the order first run
    rounds: dict[tuple[str, int], list[float]] = {}
    hf_rounds: list[float] = []  # HF plain tokens/s, one per round
    with TritonServer(SERVE_SCRIPT, repository, args.log_dir / f"server-{server_name}.log", env) as server:
        progress.write(f"{server_name}: tritonserver ready on {server.grpc_url} (log {server.log_path})")
        warm_up(server, [Job(prompts[0], args.max_tokens, k, args.ignore_eos) for k in (0, max(args.ks))],
                burst=max(args.concurrency))  # fmt: skip
        for round_ in range(args.rounds):
            for concurrency in args.concurrency:
                for name, _, k in configs:
                    suffix = f" (round {round_ + 1}/{args.rounds})" if args.rounds > 1 else ""
                    progress.phase(f"{name} c={concurrency}{suffix}")
                    schema = guide if name.endswith(GUIDED) else None  # under it, the grammar decides the end
                    jobs = [Job(p, args.max_tokens, k, args.ignore_eos and schema is None, guide=schema) for p in prompts]
                    measured = measure_phase(server, jobs, concurrency, progress.step)
                    key = (name, concurrency)
                    phases[key] = measured if key not in phases else phases[key] + measured
                    rounds.setdefault(key, []).append(measured.tokens_per_s)
                if concurrency == 1 and hf_plain is not None:
                    progress.phase(f"hf plain beside {server_name} (round {round_ + 1}/{args.rounds})")
                    hf_rounds.append(hf_plain())
    kinds = {name: (kind, k) for name, kind, k in configs}
    rows = []
    for (name, concurrency), measured in phases.items():
        kind, k = kinds[name]
        row = phase_row(measured)
        outputs[(name, concurrency)] = [r.text for r in measured.results]
        guided = name.endswith(GUIDED)
        row.update(config=name, kind=kind, concurrency=concurrency, k=k, method=method, server=server_name,
                   proposer=None if k == 0 else method, baseline=k0_name(server_name) + (GUIDED if guided else ""),
                   rounds=args.rounds, tokens_per_s_rounds=rounds[(name, concurrency)])  # fmt: skip
        if guided:  # against the same configuration unguided, round by round
            free = rounds[(name.removesuffix(GUIDED), concurrency)]
            row["x_unguided"] = statistics.median(g / f for g, f in zip(rounds[(name, concurrency)], free) if f)
        if concurrency == 1 and hf_rounds:
            row["hf_plain_tokens_per_s_rounds"] = hf_rounds
        if k is not None:  # the server counts positions up to its configured k; this phase drafts at most k
            row["per_position_acceptance"] = row.get("per_position_acceptance", [])[:k]
        if concurrency > 1:  # component models overlap in time: not a per-step overhead any more
            row["step_overhead_ms_concurrent"] = row.pop("step_overhead_ms")
        rows.append(row)
    return rows


def main() -> None:
    args = parse_args()
    transformers.utils.logging.disable_progress_bar()  # one progress bar: the benchmark's
    torch.set_num_threads(args.threads)
    command = "python " + " ".join(shlex.quote(a) for a in [str(Path(sys.argv[0])), *sys.argv[1:]])
    commit, dirty = (args.commit, False) if args.commit else report.git_commit(REPO_ROOT)
    out_path = report.result_path(args.out_dir, commit)
    args.log_dir = args.log_dir or REPO_ROOT / "runs" / out_path.stem
    args.log_dir.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = server_parameter(args.repository, TARGET_MODEL, "dtype", "auto")
    shipped = shipped_configuration(args.repository)

    tokenizer = load_tokenizer(args.target)
    prompts = select_prompts(held_out_texts(), lambda t: tokenizer(t)["input_ids"], args.num_prompts,
                             args.prompt_tokens, args.seed)
    print(f"[bench] {len(prompts)} held-out prompts, {sum(len(p.token_ids) for p in prompts) / len(prompts):.0f} "
          f"tokens on average; target {args.target}, draft {args.draft}, dtype {dtype}, device {device}, "
          f"{torch.get_num_threads()} torch threads")
    target = load_causal_lm(args.target, dtype=dtype, device=device)
    draft = load_causal_lm(args.draft, dtype=dtype, device=device)
    step_times, roofline, step_times_eager, timing_notes = in_process_timings(args, target, draft, dtype, device)
    for line in timing_notes:
        print(f"[bench] {line}")

    num_hf = (1 + (0 if args.synthetic_acceptance_rate is not None else 2 * len(args.ks))) if args.hf else 0
    num_configs = (len(args.methods) * (1 + len(args.ks)) + 2 * (shipped["method"] in args.methods)) * (1 + args.json)
    progress = Progress(len(prompts) * (num_hf + args.rounds * len(args.concurrency) * num_configs))
    rows: list[dict] = []
    outputs: Outputs = {}
    try:
        if args.hf:
            rows += hf_rows(args, prompts, target, draft, tokenizer, outputs, progress)
        del draft  # the servers load their own copies; the target stays for the paired HF plain rounds
        hf_plain = (lambda: hf_plain_tokens_per_s(args, prompts, target, tokenizer)) if args.hf else None
        with tempfile.TemporaryDirectory(prefix="specdec-bench-") as tmp:
            for method in args.methods:
                rows += server_rows(args, method, method_of(method), shipped, prompts, Path(tmp), outputs, progress,
                                    hf_plain)  # fmt: skip
            if shipped["method"] in args.methods:
                rows += server_rows(args, DEFAULT_SERVER, shipped["method"], shipped, prompts, Path(tmp), outputs,
                                    progress, hf_plain)  # fmt: skip
    finally:
        progress.close()
    annotate(rows, step_times)
    free = [r for r in rows if not r["config"].endswith(GUIDED)]
    match_reference(free, outputs, HF_PLAIN if args.hf else k0_name(args.methods[0]))
    for server in {r["server"] for r in rows if r["config"].endswith(GUIDED)}:  # under the guide: its k = 0's
        match_reference([r for r in rows if r["config"].endswith(GUIDED) and r["server"] == server], outputs,
                        k0_name(server) + GUIDED)  # fmt: skip
    notes = [*timing_notes, *args.note]
    if any(m.endswith(BESIDE_SUFFIX) for m in args.methods):
        notes.append("METHOD+beside servers: run_with_target on draft_proposer (the draft in target_verifier's "
                     "process, one call a step), each against its own k = 0")
    if any(method_of(m) == "suffix" or suffix_first(m) for m in args.methods):
        notes.append("suffix servers keep no global tree (suffix_decoding_max_cached_requests 0), the default "
                     "server's included: the phases repeat the same prompts, so a tree would draft their earlier "
                     "outputs; the tree's gain on repeated work is measured by scripts/benchmark_repeat.py")
    if shipped["method"] not in args.methods:
        notes.append(f"No default row: the repository's own method {shipped['method']!r} is not in --methods")
    elif max(args.ks) > shipped["num_speculative_tokens"]:
        notes.append(f"The default row drafts up to k = {max(args.ks)} (--ks), not the shipped "
                     f"{shipped['num_speculative_tokens']}: a request may ask for at most the configured k")
    if args.synthetic_acceptance_rate is not None:
        notes.append(f"Synthetic rejection sampler, acceptance rate {args.synthetic_acceptance_rate}: "
                     "outputs are not the target's")
    workload = {"num_prompts": len(prompts), "prompt_tokens": args.prompt_tokens, "max_tokens": args.max_tokens,
                "ignore_eos": args.ignore_eos, "greedy": True, "device": device, "dtype": dtype,
                "threads": torch.get_num_threads(), "rounds": args.rounds}  # fmt: skip
    result = report.result_document(
        rows, command=command, args=vars(args), commit=commit, dirty=dirty, workload=workload,
        default_configuration=shipped, notes=notes, prompts=[p.source for p in prompts],
        step_times_ms=step_times, step_times_eager_ms=step_times_eager, roofline=roofline,
    )  # fmt: skip
    out_path.parent.mkdir(parents=True, exist_ok=True)
    out_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\n{report.machine_line(result)}\n\n{report.markdown_table(rows)}\n\n"
          f"{report.markdown_table(rows, report.DETAIL_COLUMNS)}\n")
    print(f"[bench] results written to {out_path}; plot them with: python scripts/plot_benchmarks.py {out_path}")
    for server in servers_in(rows):
        try:
            _, table = read_table(rows, server)
        except ValueError:  # no concurrency 1, or no paired rounds: no table to read
            continue
        print(f"[bench] {server}: this run gives num_speculative_tokens_per_batch_size {table!r} "
              f"(python scripts/speculation_table.py {out_path} --server {server}: why, and --write DIR sets it)")


if __name__ == "__main__":
    main()
