"""What a benchmark run writes for people: the machine, a markdown table, a plot."""
from __future__ import annotations

import math
import os
import platform
from pathlib import Path

# (column header, result key, format) of the markdown table, one row per configuration x concurrency.
COLUMNS = (
    ("config", "config", "{}"),
    ("conc.", "concurrency", "{}"),
    ("tok/s/stream", "tokens_per_s_per_stream", "{:.1f}"),
    ("tok/s total", "tokens_per_s_aggregate", "{:.1f}"),
    ("speedup", "speedup", "{:.2f}x"),
    ("TTFT p50 ms", "ttft_ms_p50", "{:.1f}"),
    ("ITL p50/p99 ms", ("itl_ms_p50", "itl_ms_p99"), "{:.1f} / {:.1f}"),
    ("accept", "acceptance_rate", "{:.2f}"),
    ("mean len", "mean_accepted_length", "{:.2f}"),
    ("tok/pass", "tokens_per_step", "{:.2f}"),
    ("seqs/forward", "target_sequences_per_execution", "{:.2f}"),
    ("per-position accept", "per_position_acceptance", None),
    ("bound", "speedup_bound", "{:.2f}x"),
    ("efficiency", "efficiency", "{:.0%}"),
    ("overhead ms/step", "step_overhead_ms", "{:.2f}"),
    ("= ref", "identical_outputs", "{:.0%}"),
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


def format_cell(row: dict, key, fmt: str | None) -> str:
    """One table cell; missing or NaN figures are written as a dash."""
    keys = key if isinstance(key, tuple) else (key,)
    values = [row.get(k) for k in keys]
    if fmt is None:  # a list of rates
        rates = values[0]
        return " ".join(f"{r:.2f}" for r in rates) if rates else "-"
    if any(v is None or (isinstance(v, float) and math.isnan(v)) for v in values):
        return "-"
    return fmt.format(*values)


def markdown_table(rows: list[dict]) -> str:
    header = "| " + " | ".join(c[0] for c in COLUMNS) + " |"
    rule = "|" + "|".join("---" for _ in COLUMNS) + "|"
    body = ["| " + " | ".join(format_cell(r, key, fmt) for _, key, fmt in COLUMNS) + " |" for r in rows]
    return "\n".join([header, rule, *body])


def markdown_section(rows: list[dict], machine: dict, command: str, date: str, notes: list[str]) -> str:
    gpu = machine.get("gpu") or "none"
    lines = [
        f"### Serving benchmark run, {date}",
        "",
        f"- Machine: {machine['cpu']}, {machine['cores']} cores, GPU: {gpu}",
        f"- Command: `{command}`",
        *(f"- {note}" for note in notes),
        "",
        markdown_table(rows),
        "",
    ]
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> str:
    """Throughput per configuration and concurrency as a PNG; returns a message saying what happened."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed; no plot written"
    configs = list(dict.fromkeys(r["config"] for r in rows))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    colors = plt.get_cmap("tab20").colors  # 20 distinct colors: a run can have more than the default 10 configs
    for index, config in enumerate(configs):
        points = sorted((r["concurrency"], r["tokens_per_s_aggregate"]) for r in rows if r["config"] == config)
        marker = "s" if config.startswith("hf ") else "o"  # in-process rows apart from served ones
        ax.plot([p[0] for p in points], [p[1] for p in points], marker=marker, color=colors[index % len(colors)],
                label=config)
    ax.set_xlabel("concurrent requests")
    ax.set_ylabel("output tokens/s (aggregate)")
    ax.set_xscale("log", base=2)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return f"plot written to {path}"
