"""What a benchmark run writes: one JSON document per run, and markdown tables on stdout.

The JSON (``benchmarks/results/<UTC date-time>-<short commit>.json``) is the raw
record; ``docs/benchmarks.md`` and the plots (``scripts/plot_benchmarks.py``) are made
from it by hand and never written by the benchmark itself.

Top-level keys of the document (``SCHEMA_VERSION``):

* ``schema_version``, ``date`` (UTC, ISO 8601), ``commit`` (short hash), ``commit_dirty``,
  ``command`` (as typed), ``args`` (every option after parsing);
* ``machine``: ``cpu`` (model name), ``cores``, ``gpu`` (name or null), ``platform``;
  ``versions``: ``python``, ``torch``, ``transformers``;
* ``workload``, ``default_configuration``, ``notes``, ``prompts`` (sources);
* ``step_times_ms``, ``step_times_eager_ms``, ``roofline`` (in-process timings);
* ``rows``: one per configuration and concurrency (keys: ``bench.results``; figures:
  ``bench.phase.phase_row`` and ``bench.stats.latency_summary``).
"""
from __future__ import annotations

import math
import os
import platform
import subprocess
import time
from pathlib import Path

SCHEMA_VERSION = 1

# (column header, row key, format): the figures of docs/benchmarks.md, one row per configuration x concurrency.
COLUMNS = (
    ("configuration", "config", "{}"),
    ("concurrency", "concurrency", "{}"),
    ("tokens/s", "tokens_per_s_aggregate", "{:.1f}"),
    ("x k = 0", "x_k0", "{:.2f}x"),
    ("x k = 0, median of rounds", "x_k0_median", "{:.2f}x"),
    ("x HF plain", "x_hf_plain", "{:.2f}x"),
    ("x HF plain, median of rounds", "x_hf_plain_median", "{:.2f}x"),
    ("ITL p50 ms", "itl_ms_p50", "{:.1f}"),
    ("tokens per verify step", "tokens_per_step", "{:.2f}"),
    ("acceptance", "acceptance_rate", "{:.2f}"),
)

# The rest, for reading a run closely.
DETAIL_COLUMNS = (
    ("configuration", "config", "{}"),
    ("conc.", "concurrency", "{}"),
    ("tok/s/stream", "tokens_per_s_per_stream", "{:.1f}"),
    ("TTFT p50 ms", "ttft_ms_p50", "{:.1f}"),
    ("ITL p99 ms", "itl_ms_p99", "{:.1f}"),
    ("mean len", "mean_accepted_length", "{:.2f}"),
    ("per-position accept", "per_position_acceptance", None),
    ("seqs/forward", "target_sequences_per_execution", "{:.2f}"),
    ("suffix share", "suffix_share", "{:.0%}"),
    ("accepted/step suffix", "accepted_per_step_suffix", "{:.2f}"),
    ("accepted/step model", "accepted_per_step_model", "{:.2f}"),
    ("bound", "speedup_bound", "{:.2f}x"),
    ("efficiency", "efficiency", "{:.0%}"),
    ("overhead ms/step", "step_overhead_ms", "{:.2f}"),
    ("= ref", "identical_outputs", "{:.0%}"),
    ("x unguided (rounds)", "x_unguided", "{:.2f}x"),  # --json: under the schema against the same config free
)


def machine_info() -> dict[str, str | int | None]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = None
    try:
        import torch

        if torch.cuda.is_available():
            gpu = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "gpu": gpu, "platform": platform.platform()}


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("torch", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out


def git_commit(repo_root: Path) -> tuple[str, bool]:
    """(short commit hash, whether tracked files differ from it); ``("unknown", False)`` outside a git checkout."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo_root), *args], capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()  # fmt: skip

    try:
        return git("rev-parse", "--short", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return "unknown", False


def result_path(out_dir: Path, commit: str, now: float | None = None) -> Path:
    """``<out_dir>/<UTC date-time>-<short commit>.json``: names sort by date."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(now))
    return Path(out_dir) / f"{stamp}-{commit}.json"


def result_document(rows: list[dict], *, command: str, args: dict, commit: str, dirty: bool, **sections) -> dict:
    """The JSON document of one run; ``sections`` (workload, notes, step times, ...) go in at the top level."""
    return {
        "schema_version": SCHEMA_VERSION,
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "commit": commit,
        "commit_dirty": dirty,
        "command": command,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in args.items()},
        "machine": machine_info(),
        "versions": versions(),
        **sections,
        "rows": rows,
    }


def format_cell(row: dict, key: str, fmt: str | None) -> str:
    """One table cell; missing or NaN figures are written as a dash."""
    value = row.get(key)
    if fmt is None:  # a list of rates
        return " ".join(f"{r:.2f}" for r in value) if value else "-"
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def markdown_table(rows: list[dict], columns=COLUMNS) -> str:
    header = "| " + " | ".join(c[0] for c in columns) + " |"
    rule = "|" + "|".join("---" for _ in columns) + "|"
    body = ["| " + " | ".join(format_cell(r, key, fmt) for _, key, fmt in columns) + " |" for r in rows]
    return "\n".join([header, rule, *body])


def machine_line(result: dict) -> str:
    """The one line naming where and when a run was taken, as docs/benchmarks.md shows it."""
    machine, v = result["machine"], result.get("versions", {})
    commit = result["commit"] + (" (uncommitted changes)" if result.get("commit_dirty") else "")
    return (f"{machine['cpu']}, {machine['cores']} cores, GPU: {machine.get('gpu') or 'none'}; commit {commit}; "
            f"{result['date']}; torch {v.get('torch')}, transformers {v.get('transformers')}")  # fmt: skip
