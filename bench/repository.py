"""Model repository variants: a copy of ``model_repository/`` with edited parameters.

Each benchmark configuration (proposer method, models, sampler method, k) is a copy
of the repository whose ``config.pbtxt`` files get new ``parameters`` values; the
models read them once in ``initialize``. Only existing keys are edited: the models
reject keys they do not know, so asking for one is an error here already. Path
parameters are relative to the repository directory, so the copy's relative paths
are made absolute against the original.
"""
from __future__ import annotations

import re
import shutil
from pathlib import Path

# parameters { key: "name" value: { string_value: "..." } }, with or without commas.
_PARAM = re.compile(
    r'key\s*:\s*"(?P<key>[^"]+)"\s*,?\s*'
    r'value\s*:\s*\{\s*string_value\s*:\s*"(?P<value>(?:[^"\\]|\\.)*)"\s*\}'
)


BESIDE_SUFFIX = "+beside"  # the proposer in target_verifier's process (run_with_target): one call a step
SUFFIX_FIRST = "+suffix"  # a model method with suffix decoding in front of it (enable_suffix_decoding)


def method_of(name: str) -> str:
    """The proposer method a configuration serves: ``eagle3+beside`` and ``eagle3+suffix+beside`` serve ``eagle3``."""
    return name.removesuffix(BESIDE_SUFFIX).removesuffix(SUFFIX_FIRST)


def suffix_first(name: str) -> bool:
    """Whether the configuration puts suffix decoding in front of its model: ``eagle3+suffix``, ``eagle3+suffix+beside``."""
    return name.removesuffix(BESIDE_SUFFIX).endswith(SUFFIX_FIRST)


def variant_edits(name: str, edits: dict[str, dict[str, str]], model_k: int = 0,
                  min_score: float | None = None) -> dict[str, dict[str, str]]:  # fmt: skip
    """``edits`` with what the configuration's name asks for: ``+beside``, ``run_with_target`` on
    draft_proposer; ``+suffix`` (before ``+beside``), ``enable_suffix_decoding`` with
    ``model_num_speculative_tokens`` ``model_k`` (0: the step's k) and ``suffix_decoding_min_score``
    ``min_score`` (None: the model's default)."""
    if name.endswith(BESIDE_SUFFIX):
        edits.setdefault("draft_proposer", {})["run_with_target"] = "true"
    if suffix_first(name):
        edits.setdefault("draft_proposer", {}).update(
            enable_suffix_decoding="true", model_num_speculative_tokens=str(model_k) if model_k else "",
            suffix_decoding_min_score="" if min_score is None else str(min_score))  # fmt: skip
    return edits


def get_parameters(pbtxt: str) -> dict[str, str]:
    """``{key: string_value}`` of every ``parameters`` entry in a ``config.pbtxt`` text."""
    return {m.group("key"): m.group("value") for m in _PARAM.finditer(pbtxt)}


def set_parameters(pbtxt: str, values: dict[str, str], where: str = "config.pbtxt") -> str:
    """Return ``pbtxt`` with the given parameters' string values replaced.

    Raises KeyError naming the missing key and the keys that exist.
    """
    present = get_parameters(pbtxt)
    missing = [k for k in values if k not in present]
    if missing:
        raise KeyError(f"{where}: no parameter {missing[0]!r}; it declares {sorted(present)}")

    def replace(match: re.Match) -> str:
        key = match.group("key")
        if key not in values:
            return match.group(0)
        escaped = str(values[key]).replace("\\", "\\\\").replace('"', '\\"')
        start, end = match.span("value")
        base = match.start(0)
        text = match.group(0)
        return text[: start - base] + escaped + text[end - base :]

    return _PARAM.sub(replace, pbtxt)


def absolute_paths(pbtxt: str, base_dir: Path) -> dict[str, str]:
    """The parameters holding a relative path (a value with a ``/`` that exists under ``base_dir``), made absolute."""
    out = {}
    for key, value in get_parameters(pbtxt).items():
        if "/" in value and not Path(value).is_absolute() and (base_dir / value).exists():
            out[key] = str((base_dir / value).resolve())
    return out


def checkpoint_edits(
    target: Path | None = None, method: str | None = None, draft: Path | None = None, tokenizer: Path | None = None,
) -> dict[str, dict[str, str]]:
    """The ``make_variant`` edits that serve these checkpoints, as absolute paths.

    The target goes to target_verifier, and draft_proposer's own ``target_model`` is
    cleared, so that a head drafts for target_verifier's (one owner); the tokenizer and
    detokenizer get the target's tokenizer (the one whose ids index its logits) unless
    ``tokenizer`` names another. ``draft`` is ``method``'s checkpoint: a draft model or a head.
    """
    edits: dict[str, dict[str, str]] = {}
    tokenizer = tokenizer or target
    if target:
        edits["target_verifier"] = {"target_model": str(Path(target).resolve())}
        edits["draft_proposer"] = {"target_model": ""}
    if tokenizer:
        for model in ("tokenizer", "detokenizer"):
            edits[model] = {"tokenizer_dir": str(Path(tokenizer).resolve())}
    if method:
        edits.setdefault("draft_proposer", {})["method"] = method
    if draft:
        edits.setdefault("draft_proposer", {})["draft_model"] = str(Path(draft).resolve())
    return edits


def make_variant(source: Path, dest: Path, edits: dict[str, dict[str, str]]) -> Path:
    """Copy the repository ``source`` to ``dest`` and apply ``{model: {key: value}}`` edits."""
    source, dest = Path(source).resolve(), Path(dest)
    unknown = [m for m in edits if not (source / m / "config.pbtxt").is_file()]
    if unknown:
        models = sorted(p.parent.name for p in source.glob("*/config.pbtxt"))
        raise KeyError(f"model repository {source} has no model {unknown[0]!r}; it has {models}")
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for config in sorted(dest.glob("*/config.pbtxt")):
        model = config.parent.name
        text = config.read_text()
        values = {**absolute_paths(text, source), **edits.get(model, {})}
        config.write_text(set_parameters(text, values, where=f"{model}/config.pbtxt"))
    return dest


def parameter_edits(settings: list[str]) -> dict[str, dict[str, str]]:
    """``["model.key=value", ...]`` (command-line settings) as ``make_variant`` edits."""
    edits: dict[str, dict[str, str]] = {}
    for setting in settings:
        name, sep, value = setting.partition("=")
        model, dot, key = name.partition(".")
        if not (sep and dot and model and key):
            raise ValueError(f"--param must look like MODEL.KEY=VALUE, got {setting!r}")
        edits.setdefault(model, {})[key] = value
    return edits
