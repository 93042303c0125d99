#!/usr/bin/env python3
"""Write the docs' parameter tables from the declarations in ``specdec_triton/parameters.py``.

    python scripts/parameter_tables.py           # rewrite every table in place
    python scripts/parameter_tables.py --check   # exit 1, naming each table that differs

A table sits in a page of ``docs/`` (or the README) between ``<!-- parameters:MODEL -->`` and
``<!-- /parameters -->``; every model's parameters need one table somewhere (the tokenizer's
serves the detokenizer, which reads the same). Its rows are the declarations in order: key,
default (and the committed ``model_repository/MODEL/config.pbtxt``'s value where it differs),
allowed values, meaning. So a default, a bound or a meaning is edited in the declaration, and
the page follows; ``tests/test_parameter_tables.py`` runs the check, so they cannot drift apart.
``--check`` also names a committed ``config.pbtxt`` key that no declaration knows (its model
would refuse to load).
"""
from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))  # this checkout's packages, whichever checkout the venv installed

from bench.repository import get_parameters  # noqa: E402
from specdec_triton.parameters import MODELS, Parameter  # noqa: E402

_BLOCK = re.compile(r"<!-- parameters:(?P<model>[a-z_]+) -->\n(?P<table>.*?)<!-- /parameters -->", re.DOTALL)
_KIND_TEXT = {"str": "text", "int": "integer", "float": "number", "bool": "boolean", "path": "path",
              "pattern": "regular expression"}  # fmt: skip
_TRUE = ("true", "1", "yes", "on")


def _code(value) -> str:
    if value is None or value == "":
        return "empty"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value:g}`" if isinstance(value, float) else f"`{value}`"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _same(parameter: Parameter, shipped: str) -> bool:
    """Whether the committed value is the default (an empty value is: it reads as unset)."""
    if shipped.strip() == "" or parameter.default is None:
        return shipped.strip() == ""
    if parameter.kind == "bool":
        return (shipped.strip().lower() in _TRUE) == parameter.default
    if parameter.kind in ("int", "float"):
        try:
            return float(shipped) == float(parameter.default)
        except ValueError:
            return False
    return shipped == parameter.default


def default_text(parameter: Parameter, shipped: str | None) -> str:
    text = _code(parameter.default)
    if parameter.default is None and parameter.unset:
        text = f"empty: {parameter.unset}"
    if shipped is not None and not _same(parameter, shipped):
        text += f" (shipped: {_code(shipped)})"
    return text


def values_text(parameter: Parameter) -> str:
    if parameter.choices is not None:
        return " | ".join(f"`{choice}`" for choice in parameter.choices)
    low, high, rule = parameter.minimum, parameter.maximum, parameter.allowed
    bounds = (f" in [{low:g}, {high:g}]" if low is not None and high is not None else
              f" >= {low:g}" if low is not None else f" <= {high:g}" if high is not None else "")  # fmt: skip
    if rule and not bounds and rule.startswith(("<", ">", "in ")):
        return f"{_KIND_TEXT[parameter.kind]} {rule}"  # a bound checked elsewhere: "integer >= 1"
    return _KIND_TEXT[parameter.kind] + bounds + (f"; {rule}" if rule else "")


def table(model: str, repository: Path = REPO_ROOT / "model_repository") -> str:
    """The markdown table of ``model``'s declared parameters, ending in a newline."""
    config = repository / model / "config.pbtxt"
    shipped = get_parameters(config.read_text()) if config.is_file() else {}
    rows = ["| key | default | values | meaning |", "|---|---|---|---|"]
    rows += [f"| `{p.name}` | {_cell(default_text(p, shipped.get(p.name)))} | {_cell(values_text(p))} | "
             f"{_cell(p.meaning)} |" for p in MODELS[model]]  # fmt: skip
    return "\n".join(rows) + "\n"


def pages(root: Path = REPO_ROOT) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def update(root: Path = REPO_ROOT, write: bool = True) -> list[str]:
    """Rewrite (or, ``write`` False, only compare) every table; the problems found, each naming where."""
    problems, tabled = [], set()
    for page in pages(root):
        text = page.read_text()

        def fill(match: re.Match) -> str:
            model, name = match.group("model"), page.relative_to(root)
            if model not in MODELS:
                problems.append(f"{name}: <!-- parameters:{model} --> names no model; models: {sorted(MODELS)}")
                return match.group(0)
            tabled.add(id(MODELS[model]))
            fresh = table(model, root / "model_repository")
            if match.group("table") != fresh and not write:
                problems.append(f"{name}: the {model} table differs from specdec_triton/parameters.py "
                                f"(python scripts/parameter_tables.py rewrites it)")  # fmt: skip
            return f"<!-- parameters:{model} -->\n{fresh}<!-- /parameters -->"

        new = _BLOCK.sub(fill, text)
        if write and new != text:
            page.write_text(new)
    for model, declared in MODELS.items():  # a tuple two models share is named once, by its first
        if id(declared) not in tabled:
            problems.append(f"no page has a table of {model}'s parameters (<!-- parameters:{model} -->)")
            tabled.add(id(declared))
    return problems + _undeclared(root / "model_repository")


def _undeclared(repository: Path) -> list[str]:
    """Committed config.pbtxt keys that no declaration knows."""
    problems = []
    for model, declared in MODELS.items():
        config = repository / model / "config.pbtxt"
        known = {p.name for p in declared}
        if config.is_file():
            problems += [f"{config.relative_to(repository.parent)}: parameter '{key}' is not declared for {model} "
                         f"in specdec_triton/parameters.py" for key in get_parameters(config.read_text())
                         if key not in known]  # fmt: skip
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 naming each table that drifted")
    args = parser.parse_args(argv)
    problems = update(write=not args.check)
    for problem in problems:
        print(problem, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
