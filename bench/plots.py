"""Plots of one benchmark run (``benchmarks/results/*.json``): the series they show, then the PNGs.

The series are pure functions of the result document, tested without drawing:

* :func:`concurrency_series` -- a figure (tokens/s, ITL p50) against concurrency, one line
  per served configuration (k = 0, each fixed k, ``default``);
* :func:`reference_levels` -- the configurations measured at one concurrency only (the
  in-process HF rows, one request at a time): drawn as horizontal reference lines;
* :func:`acceptance_series` -- acceptance rate per draft position, per method and k.

:func:`write_plots` draws them with matplotlib (Agg backend, no display needed).
"""
from __future__ import annotations

import math
from pathlib import Path

from bench.results import DEFAULT_NAME

SERVED_KINDS = ("k0", "fixed", "default")
FIGURES = {  # file name -> (row key, axis label)
    "throughput.png": ("tokens_per_s_aggregate", "output tokens/s (all streams)"),
    "itl_p50.png": ("itl_ms_p50", "ITL p50 (ms)"),
}
ACCEPTANCE_PNG = "acceptance_per_position.png"


def _number(value) -> float | None:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return float(value)


def concurrency_series(result: dict, key: str) -> dict[str, list[tuple[int, float]]]:
    """``{config: [(concurrency, value), ...]}`` of the served rows, by concurrency; missing values left out."""
    series: dict[str, list[tuple[int, float]]] = {}
    for row in result["rows"]:
        if row.get("kind") in SERVED_KINDS and (value := _number(row.get(key))) is not None:
            series.setdefault(row["config"], []).append((row["concurrency"], value))
    return {config: sorted(points) for config, points in series.items()}


def reference_levels(result: dict, key: str) -> dict[str, float]:
    """``{config: value}`` of the rows that are not served and exist at concurrency 1 only (the HF rows)."""
    by_config: dict[str, list[dict]] = {}
    for row in result["rows"]:
        if row.get("kind") not in SERVED_KINDS:
            by_config.setdefault(row["config"], []).append(row)
    levels = {}
    for config, rows in by_config.items():
        if [r["concurrency"] for r in rows] == [1] and (value := _number(rows[0].get(key))) is not None:
            levels[config] = value
    return levels


def acceptance_series(result: dict) -> dict[str, list[float]]:
    """``{config: [rate at draft position 1, 2, ...]}`` of the drafting server rows, at their lowest concurrency.

    Greedy acceptance does not depend on how many requests share a step, so one
    concurrency per configuration says it; the lowest has the fewest batching effects.
    """
    series: dict[str, tuple[int, list[float]]] = {}
    for row in result["rows"]:
        rates = row.get("per_position_acceptance") or []
        if row.get("kind") not in ("fixed", "default") or not rates:
            continue
        if row["config"] not in series or row["concurrency"] < series[row["config"]][0]:
            series[row["config"]] = (row["concurrency"], [float(r) for r in rates])
    return {config: rates for config, (_, rates) in series.items()}


def _styles(configs: list[str], kinds: dict[str, str | None]) -> dict[str, dict]:
    """k = 0 black and dashed, ``default`` red and thick, each fixed configuration a colour of its own."""
    import matplotlib.pyplot as plt

    palette = [c for i, c in enumerate(plt.get_cmap("tab10").colors) if i not in (3, 7)]  # no red, no grey
    styles, fixed, k0 = {}, 0, 0
    for config in configs:
        if kinds.get(config) == "k0":  # one per server: told apart by the marker
            styles[config] = {"color": "black", "linestyle": "--", "marker": "osv^"[k0 % 4]}
            k0 += 1
        elif kinds.get(config) == "default":  # the shipped configuration; a second one (target here) dotted
            styles[config] = {"color": "tab:red", "linewidth": 2.5, "marker": "D",
                              "linestyle": "-" if config == DEFAULT_NAME else ":"}  # fmt: skip
        elif kinds.get(config) == "fixed":
            styles[config] = {"color": palette[fixed % len(palette)], "marker": "o"}
            fixed += 1
    return styles


def write_plots(result: dict, out_dir: Path) -> list[Path]:
    """Draw the three PNGs of ``result`` into ``out_dir``; returns their paths."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    kinds = {r["config"]: r.get("kind") for r in result["rows"]}
    styles = _styles(list(kinds), kinds)
    subtitle = _subtitle(result)
    written = []
    for name, (key, label) in FIGURES.items():
        fig, ax = plt.subplots(figsize=(10, 4.5))
        for config, points in concurrency_series(result, key).items():
            ax.plot([p[0] for p in points], [p[1] for p in points], label=config, **styles[config])
        for index, (config, value) in enumerate(reference_levels(result, key).items()):
            ax.axhline(value, color=plt.get_cmap("Dark2").colors[index % 8], linestyle=":", linewidth=1.5,
                       label=f"{config} (one request at a time)")  # fmt: skip
        ax.set_xscale("log", base=2)
        concurrencies = sorted({r["concurrency"] for r in result["rows"]})
        ax.set_xticks(concurrencies, [str(c) for c in concurrencies])
        ax.minorticks_off()
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel(label)
        _finish(fig, ax, out_dir / name, subtitle)
        written.append(out_dir / name)
    fig, ax = plt.subplots(figsize=(10, 4.5))
    for config, rates in acceptance_series(result).items():
        ax.plot(range(1, len(rates) + 1), rates, label=config, **styles[config])
    ax.set_xlabel("draft position")
    ax.set_ylabel("accepted at this position / steps that drafted")
    ax.set_ylim(0, 1.05)
    ax.xaxis.get_major_locator().set_params(integer=True)
    _finish(fig, ax, out_dir / ACCEPTANCE_PNG, subtitle)
    written.append(out_dir / ACCEPTANCE_PNG)
    return written


def _subtitle(result: dict) -> str:
    machine = result.get("machine", {})
    gpu = machine.get("gpu") or "no GPU"
    return f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores, {gpu}; {result.get('commit', '?')}, " \
           f"{result.get('date', '?')}"


def _finish(fig, ax, path: Path, subtitle: str) -> None:
    import matplotlib.pyplot as plt

    ax.set_title(subtitle, fontsize=8)
    ax.grid(True, alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
