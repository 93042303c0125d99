"""vLLM's ``speculative_config``: one JSON, with vLLM's keys, that sets the repository's per-model keys.

Users coming from vLLM (or Triton's vLLM backend, whose ``model.json`` takes
``"speculative_config": {...}``) describe speculation in one JSON. Here it may come
from two places, which must agree if both are set:

- ``scripts/serve.sh --speculative-config '<json>'`` (or ``@file.json``), which
  checks it before the server starts and passes it in ``SPECDEC_SPECULATIVE_CONFIG``;
- the parameter ``speculative_config`` of ``speculative_decoding/config.pbtxt``.

Each model applies the keys that concern it over its own ``config.pbtxt`` while it
loads. A per-model key left empty or at its shipped value is overridden; one set to
anything else must agree with the JSON, or the load fails naming both, so two places
never silently disagree. As in vLLM, k is fixed for every batch size: the JSON clears
``num_speculative_tokens_per_batch_size`` (only ``disable_by_batch_size`` turns
speculation off under load). A key we do not know is refused with the supported list;
a vLLM key we do not support is refused as "not supported".
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

ENV_VAR = "SPECDEC_SPECULATIVE_CONFIG"
PARAMETER = "speculative_config"  # in the orchestrator's config.pbtxt
ORCHESTRATOR = "speculative_decoding"
METHODS = ("draft_model", "ngram", "suffix", "eagle3", "mlp_speculator", "medusa", "mtp", "dflash")
PARALLEL_DRAFTING_METHODS = ("draft_model", "eagle3")  # specdec.methods' parallel_drafting, torch-free as METHODS is


class SpeculativeConfigError(ValueError):
    """The JSON is malformed, names an unknown or unsupported key, or disagrees with a config.pbtxt key."""


@dataclass(frozen=True)
class Setting:
    model: str  # the model whose config.pbtxt key the vLLM key sets
    key: str
    kind: type  # what the JSON value must be: str, int, float or bool
    unset: tuple[str, ...]  # values of the pbtxt key that count as not chosen: empty and the shipped value


_SUFFIX = {
    f"suffix_decoding_{name}": Setting("draft_proposer", f"suffix_decoding_{name}", kind, ("",))
    for name, kind in (("max_tree_depth", int), ("max_cached_requests", int), ("max_spec_factor", float),
                       ("min_token_prob", float), ("use_tree_spec", bool))  # the last: Arctic Inference's
}  # fmt: skip
SETTINGS = {
    "method": Setting("draft_proposer", "method", str, ("", "suffix")),
    "model": Setting("draft_proposer", "draft_model", str, ("", "${SPECDEC_MODELS_DIR}/tiny-draft")),
    "num_speculative_tokens": Setting(ORCHESTRATOR, "num_speculative_tokens", int, ("", "8")),
    "disable_by_batch_size": Setting(ORCHESTRATOR, "speculative_disable_by_batch_size", int, ("", "0")),
    "prompt_lookup_min": Setting("draft_proposer", "prompt_lookup_min", int, ("",)),
    "prompt_lookup_max": Setting("draft_proposer", "prompt_lookup_max", int, ("",)),
    # Arctic Inference's key: suffix decoding in front of the model method (specdec.suffix_first)
    "enable_suffix_decoding": Setting("draft_proposer", "enable_suffix_decoding", bool, ("", "false")),
    "rejection_sample_method": Setting("rejection_sampler", "rejection_sample_method", str, ("", "probabilistic")),
    "speculative_token_tree": Setting("draft_proposer", "speculative_token_tree", str, ("",)),  # checked at load
    # every token of a step from one forward: a PARD draft_model or a P-EAGLE eagle3 head (refused for other methods)
    "parallel_drafting": Setting("draft_proposer", "parallel_drafting", bool, ("", "false")),
    **_SUFFIX,
}
# set by any speculative_config: vLLM has no per-batch-size table, k is fixed
# (the shipped tables, this one and the one repositories copied before it hold)
_IMPLIED = {Setting(ORCHESTRATOR, "num_speculative_tokens_per_batch_size", str, ("", "1:8,5:0", "1:8,3:0")): ""}
# vLLM keys accepted only with the value that changes nothing here
NEUTRAL = {"draft_tensor_parallel_size": (None, 1), "disable_logprobs": (None, True, False),
           "disable_log_stats": (None, True, False)}  # fmt: skip
# vLLM keys (or methods) known and not built
NOT_SUPPORTED_KEYS = ("quantization", "max_model_len", "revision", "code_revision",
                      "disable_padded_drafter_batch", "enforce_eager", "acceptance_method", "posterior_threshold",
                      "posterior_alpha", "draft_model_config", "target_model_config")  # fmt: skip
NOT_SUPPORTED_METHODS = ("eagle", "deepseek_mtp", "ernie_mtp", "qwen3_next_mtp")  # vLLM's old MTP names: "mtp"
# methods whose weights are the target's own (specdec.methods ``in_target_checkpoint``): no ``model`` key
TARGET_CHECKPOINT_METHODS = ("mtp",)


def parse(text: str) -> dict[str, dict[str, str]]:
    """The per-model keys the JSON sets: ``{model: {config.pbtxt key: value}}``; refuses what it cannot serve."""
    try:
        config = json.loads(text)
    except json.JSONDecodeError as err:
        raise SpeculativeConfigError(f"speculative_config is not valid JSON: {err}") from None
    if not isinstance(config, dict):
        raise SpeculativeConfigError(f"speculative_config must be a JSON object, got {type(config).__name__}")
    _check_keys(config)
    if "model" in config and "method" not in config:
        config = {**config, "method": "draft_model"}  # vLLM's reading of a bare model: a draft model
    settings: dict[str, dict[str, str]] = {}
    for name, value in config.items():
        if name in NEUTRAL:
            continue
        setting = SETTINGS[name]
        settings.setdefault(setting.model, {})[setting.key] = _as_text(name, value, setting.kind)
    for setting, value in _IMPLIED.items():
        settings.setdefault(setting.model, {})[setting.key] = value
    return settings


def _check_keys(config: Mapping) -> None:
    for name, value in config.items():
        if name in NOT_SUPPORTED_KEYS:
            raise SpeculativeConfigError(f"speculative_config key '{name}' is not supported by this server")
        if name in NEUTRAL and value not in NEUTRAL[name]:
            raise SpeculativeConfigError(
                f"speculative_config key '{name}' = {value!r} is not supported; allowed: {list(NEUTRAL[name])}"
            )
        if name not in SETTINGS and name not in NEUTRAL:
            raise SpeculativeConfigError(
                f"speculative_config has unknown key '{name}'; supported keys: {sorted([*SETTINGS, *NEUTRAL])}"
            )
    method = config.get("method")
    if method in NOT_SUPPORTED_METHODS:
        raise SpeculativeConfigError(f"speculative_config method '{method}' is not supported yet; built: {list(METHODS)}")
    if method is not None and method not in METHODS:
        raise SpeculativeConfigError(f"speculative_config method must be one of {list(METHODS)}, got {method!r}")
    if method in TARGET_CHECKPOINT_METHODS and "model" in config:
        raise SpeculativeConfigError(f"speculative_config key 'model' with method '{method}': its layers are read "
                                     f"from the target's checkpoint (target_verifier's target_model); leave 'model' out")
    if config.get("parallel_drafting") is True and config.get("method", "draft_model") not in PARALLEL_DRAFTING_METHODS:
        raise SpeculativeConfigError(f"speculative_config key 'parallel_drafting' true is for methods "
                                     f"{list(PARALLEL_DRAFTING_METHODS)}, not {method!r}")  # fmt: skip


def _as_text(name: str, value, kind: type) -> str:
    """The pbtxt string of a JSON value, after checking its type (the model checks its range)."""
    if kind is bool:
        if not isinstance(value, bool):
            raise SpeculativeConfigError(f"speculative_config key '{name}' must be true or false, got {value!r}")
        return "true" if value else "false"
    ok = isinstance(value, str) if kind is str else (
        isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or float(value).is_integer())
    )  # fmt: skip
    if not ok:
        raise SpeculativeConfigError(f"speculative_config key '{name}' must be {kind.__name__}, got {value!r}")
    return value if kind is str else str(int(value) if kind is int else float(value))


def configured_text(repository_dir: str | Path, environ: Mapping[str, str] = os.environ) -> str | None:
    """The JSON in force: the environment's and the repository parameter's, which must agree if both are set."""
    from_env = environ.get(ENV_VAR, "").strip() or None
    from_repository = _repository_parameter(Path(repository_dir)) or None
    if from_env and from_repository and parse(from_env) != parse(from_repository):
        raise SpeculativeConfigError(
            f"speculative_config differs between {ENV_VAR} (serve.sh --speculative-config) {from_env} and "
            f"{ORCHESTRATOR}/config.pbtxt parameter '{PARAMETER}' {from_repository}; set it in one place"
        )
    return from_env or from_repository


def apply(model_name: str, raw: Mapping[str, str], repository_dir: str | Path,
          environ: Mapping[str, str] = os.environ) -> dict[str, str]:  # fmt: skip
    """``raw`` (a model's pbtxt parameters) with the speculative_config's keys for ``model_name`` applied."""
    text = configured_text(repository_dir, environ)
    if text is None:
        return dict(raw)
    overrides = parse(text).get(model_name, {})
    unset = {s.key: s.unset for s in [*SETTINGS.values(), *_IMPLIED] if s.model == model_name}
    for key, value in overrides.items():
        current = str(raw.get(key, "")).strip()
        if current not in unset[key] and current != value:
            raise SpeculativeConfigError(
                f"{model_name}: config.pbtxt sets '{key}' = {current!r} but speculative_config sets it to {value!r}; "
                f"set it in one place (a pbtxt key left empty or at its shipped value is overridden)"
            )
    return {**raw, **overrides}


def _repository_parameter(repository_dir: Path) -> str:
    """The orchestrator's ``speculative_config`` parameter, read from its config.pbtxt (empty if absent)."""
    path = repository_dir / ORCHESTRATOR / "config.pbtxt"
    if not path.is_file():
        return ""
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    config = text_format.Parse(path.read_text(), model_config_pb2.ModelConfig(), allow_unknown_field=True)
    parameter = config.parameters.get(PARAMETER)
    return parameter.string_value.strip() if parameter is not None else ""


def _resolve_model_path(text: str, base: Path) -> str:
    """The JSON with a relative ``model`` made absolute against ``base`` (serve.sh's working directory)."""
    config = json.loads(text)
    if isinstance(config, dict) and isinstance(config.get("model"), str) and not Path(config["model"]).is_absolute():
        config["model"] = str((base / config["model"]).resolve())
    return json.dumps(config)


def main(argv: list[str]) -> int:
    """``--check JSON|@FILE``: print the JSON to serve (model path resolved), or the reason it is refused."""
    if len(argv) != 2 or argv[0] != "--check":
        print("usage: python -m specdec_triton.speculative_config --check '<json>' | @file.json", file=sys.stderr)
        return 2
    source = argv[1]
    try:
        text = Path(source[1:]).read_text() if source.startswith("@") else source
    except OSError as err:
        print(f"--speculative-config: cannot read {source[1:]}: {err}", file=sys.stderr)
        return 2
    try:
        parse(text)
    except SpeculativeConfigError as err:
        print(f"--speculative-config: {err}", file=sys.stderr)
        return 2
    print(_resolve_model_path(text, Path.cwd()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
