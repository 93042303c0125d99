#!/usr/bin/env python3
"""Read a ``num_speculative_tokens_per_batch_size`` table off a ``scripts/benchmark.py`` run, and set it.

    python scripts/benchmark.py --methods eagle3+beside --ks 2,4 --concurrency 1,2,4,8 --rounds 3
    python scripts/speculation_table.py benchmarks/results/<run>.json --server eagle3+beside --write /srv/repo

For each server of the run (or ``--server``) it prints, per concurrency, every measured k's
tokens/s over k = 0 (median of the rounds' paired ratios, and their range) and the k chosen,
then the table (``bench/speculation_table.py`` has the rule: the best k where it beats k = 0
by ``--margin``, the smaller neighbour's k between measured concurrencies). ``--write DIR``
sets it in ``DIR/speculative_decoding/config.pbtxt`` after checking that ``DIR`` serves what
the server measured (its method and where the models run), since a table measured for one
configuration says nothing about another; ``num_speculative_tokens`` is raised to the table's
largest k where it is below (a table may not ask for more), and the repository is then read
as ``scripts/new_repository.py`` reads a copy, the old text put back if a model would refuse it.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO_ROOT), str(REPO_ROOT / "scripts")]

from bench.repository import (  # noqa: E402
    BESIDE_SUFFIX,
    get_parameters,
    method_of,
    set_parameters,
    suffix_first,
)
from bench.speculation_table import DEFAULT_MARGIN, read_table, servers_in  # noqa: E402
from new_repository import ORCHESTRATOR, check_configs  # noqa: E402
from specdec.speculation_length import parse_per_batch_size  # noqa: E402
from specdec_triton.wire import DRAFT_PROPOSER as PROPOSER  # noqa: E402
from specdec_triton.wire import TARGET_VERIFIER as TARGET  # noqa: E402

TABLE_KEY, K_KEY = "num_speculative_tokens_per_batch_size", "num_speculative_tokens"

FEW_ROUNDS = 3  # fewer paired rounds than this cannot tell a k from the machine's drift


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", type=Path, help="a scripts/benchmark.py JSON (benchmarks/results/...)")
    p.add_argument("--server", help="the run's server to read (default: every server with fixed-k rows)")
    p.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                   help="a k is taken only where its tokens/s reach (1 + margin) x k = 0's")  # fmt: skip
    p.add_argument("--write", type=Path, metavar="DIR", help="a model repository to set the table in (needs --server)")
    return p.parse_args(argv)


def evidence(server: str, choices) -> str:
    """The markdown table behind one server's choice."""
    ks = sorted({k for c in choices for k in c.ratios})
    lines = [f"{server}: tokens/s over k = 0, median of paired rounds (range)",
             "| concurrency | " + " | ".join(f"k = {k}" for k in ks) + " | chosen k |",
             "|---" * (len(ks) + 2) + "|"]  # fmt: skip
    for c in choices:
        cells = [f"{c.median(k):.2f}x ({min(c.ratios[k]):.2f}-{max(c.ratios[k]):.2f})" if k in c.ratios else "-"
                 for k in ks]  # fmt: skip
        lines.append(f"| {c.concurrency} | " + " | ".join(cells) + f" | {c.k} |")
    return "\n".join(lines)


def check_repository_serves(repository: Path, server: str) -> Path:
    """``repository``'s orchestrator config, after checking that it serves what ``server`` measured: the
    proposer's method, whether it runs beside the target or behind suffix decoding."""
    config = repository / ORCHESTRATOR / "config.pbtxt"
    if not all((repository / m / "config.pbtxt").is_file() for m in (ORCHESTRATOR, PROPOSER, TARGET)):
        raise ValueError(f"{repository} is not a model repository with {ORCHESTRATOR}, {PROPOSER} and {TARGET}")
    expected = {PROPOSER: {"method": method_of(server), "run_with_target": str(server.endswith(BESIDE_SUFFIX)),
                           "enable_suffix_decoding": str(suffix_first(server))}}  # fmt: skip
    differ = []
    for model, values in expected.items():
        present = get_parameters((repository / model / "config.pbtxt").read_text())
        for key, value in values.items():
            if present.get(key, "false").lower() != value.lower():
                differ.append(f"{model}.{key} is {present.get(key)!r}, the run's {server!r} had {value.lower()!r}")
    if differ:
        raise ValueError(f"{repository} does not serve what server {server!r} measured: " + "; ".join(differ))
    return config


def write_table(repository: Path, server: str, table: str) -> list[str]:
    """Set ``table`` in ``repository`` (raising ``num_speculative_tokens`` to its largest k, the most a
    table may ask), then read the copy as the models would; a value they refuse puts the old text back."""
    config = check_repository_serves(repository, server)
    text = config.read_text()
    values = {TABLE_KEY: table}
    most = max(k for _, k in parse_per_batch_size(table))
    k = get_parameters(text).get(K_KEY, "")
    if not k.isdigit() or int(k) < most:
        values[K_KEY] = str(most)
    config.write_text(set_parameters(text, values, str(config)))
    try:
        check_configs(repository.resolve())
    except (KeyError, ValueError):
        config.write_text(text)
        raise
    return [f"set {key} {value!r} in {config}" for key, value in values.items()]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        rows = json.loads(args.run.read_text())["rows"]
    except (OSError, ValueError, KeyError) as err:
        print(f"speculation_table: cannot read {args.run} as a benchmark run: {err}", file=sys.stderr)
        return 1
    if args.write and not args.server:
        print("speculation_table: --write needs --server (the run's server whose table to set)", file=sys.stderr)
        return 1
    tables = {}
    try:
        for server in [args.server] if args.server else servers_in(rows):
            choices, tables[server] = read_table(rows, server, args.margin)
            print(evidence(server, choices))
            rounds = min(len(r) for c in choices for r in c.ratios.values())
            if rounds < FEW_ROUNDS:
                print(f"note: {rounds} paired round(s); use --rounds {FEW_ROUNDS} or more on a noisy machine")
            if choices[-1].k:
                print(f"note: k = {choices[-1].k} still pays at the largest measured concurrency, "
                      f"{choices[-1].concurrency}; the table keeps it for every larger batch (unmeasured)")
            print(f"{TABLE_KEY}: {tables[server]!r}   (new_repository.sh DIR ... --param "
                  f"{ORCHESTRATOR}.{TABLE_KEY}={tables[server]})\n")  # fmt: skip
        if args.write:
            for line in write_table(args.write, args.server, tables[args.server]):
                print(line)
    except (KeyError, ValueError) as err:
        print(f"speculation_table: error: {err.args[0] if err.args else err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
