"""Triton plumbing shared by every ``model.py``: parameters, tensors, errors, logging (BLS: ``bls.py``).

One module so that no model repeats it (the tensorrtllm_backend models each carry
their own copy of parameter parsing; vllm_backend has one boolean helper; this is the
union of both, once). It imports without Triton: ``triton_python_backend_utils``
exists only inside the Python backend stub, so it is imported on first use, and the
parameter parsing -- the part worth unit-testing -- needs none of it.
"""
from __future__ import annotations

import json
import logging
import os
import re
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from specdec.scheduler import SequenceCancelled
from specdec_triton import speculative_config
from specdec_triton.paths import MODELS_DIR_VARIABLE, resolve_path

_TRUE = ("true", "1", "yes", "on")
_FALSE = ("false", "0", "no", "off")


def triton_utils():
    """``triton_python_backend_utils``, importable only inside the Python backend stub."""
    import triton_python_backend_utils as pb_utils

    return pb_utils


# --- model parameters --------------------------------------------------------------------------


class ParameterError(ValueError):
    """A model-config parameter is missing, malformed or out of range; fails the model load."""


class Parameters:
    """Typed reads of ``parameters { key: ... value: { string_value: ... } }`` from a model config.

    Every getter names the key and the allowed values in its error. An empty
    string counts as unset, so a config may list a key without choosing a value.
    ``check_all_read`` then rejects keys nobody asked for: a misspelt parameter
    fails the load instead of being silently ignored.
    """

    def __init__(
        self, raw: Mapping[str, str], base_dir: str | None = None, component: str = "model", model_dir: str | None = None
    ):
        self._raw = {key: str(value).strip() for key, value in raw.items()}
        self._base_dir, self._model_dir = base_dir, model_dir
        self._component = component
        self._read: set[str] = set()

    @property
    def repository_dir(self) -> str | None:
        """The model repository the parameters come from (None: read outside one)."""
        return self._base_dir

    @classmethod
    def from_args(cls, args: Mapping[str, Any]) -> Parameters:
        """From ``initialize(args)``: relative paths resolve against the model repository directory."""
        config = json.loads(args["model_config"])
        raw = {key: value.get("string_value", "") for key, value in config.get("parameters", {}).items()
               if key != "specdec_reload"}  # health.RELOAD_PARAMETER: set by a reload, read by no model
        model_dir = os.path.normpath(args["model_repository"])
        raw = speculative_config.apply(args["model_name"], raw, os.path.dirname(model_dir))  # vLLM's JSON, if set
        return cls(raw, base_dir=os.path.dirname(model_dir), component=args["model_name"], model_dir=model_dir)

    def _get(self, key: str) -> str | None:
        self._read.add(key)
        value = self._raw.get(key, "")
        return value or None

    def invalid(self, key: str, value: str, allowed: str) -> ParameterError:
        """The error for ``key``'s ``value``, naming the model, the key and what it must be."""
        return ParameterError(f"{self._component}: parameter '{key}' must be {allowed}, got {value!r}")

    def get_str(self, key: str, default: str | None, choices: Sequence[str] | None = None) -> str | None:
        value = self._get(key)
        if value is None:
            return default
        if choices is not None and value not in choices:
            raise self.invalid(key, value, f"one of {tuple(choices)}")
        return value

    def get_pattern(self, key: str) -> re.Pattern | None:
        """A regular expression; None when empty."""
        value = self._get(key)
        if value is None:
            return None
        try:
            return re.compile(value)
        except re.error as err:
            raise self.invalid(key, value, f"a regular expression ({err})") from None

    def get_bool(self, key: str, default: bool) -> bool:
        value = self._get(key)
        if value is None:
            return default
        if value.lower() in _TRUE:
            return True
        if value.lower() in _FALSE:
            return False
        raise self.invalid(key, value, f"a boolean ({'/'.join(_TRUE)} or {'/'.join(_FALSE)})")

    def get_int(
        self, key: str, default: int | None, minimum: int | None = None, maximum: int | None = None
    ) -> int | None:
        return self._get_number(key, default, minimum, maximum, int, "an integer")

    def get_float(
        self, key: str, default: float | None, minimum: float | None = None, maximum: float | None = None
    ) -> float | None:
        return self._get_number(key, default, minimum, maximum, float, "a number")

    def _get_number(self, key: str, default, minimum, maximum, kind: type, noun: str):
        value = self._get(key)
        if value is None:
            return default
        try:
            number = kind(value)
        except ValueError:
            raise self.invalid(key, value, noun + _range_text(minimum, maximum)) from None
        finite = kind is int or np.isfinite(number)  # an int of any size is finite; np.isfinite of a huge one raises
        if not finite or (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
            raise self.invalid(key, value, noun + _range_text(minimum, maximum))
        return number

    def get_path(self, key: str, default: str | None, must_exist: bool = True) -> str | None:
        """A path by ``specdec_triton.paths.resolve_path``: variables expanded, relative to the repository."""
        value = self._get(key) or default
        if value is None:
            return None
        try:
            path = resolve_path(value, self._base_dir, self._model_dir)
        except ValueError as err:
            raise self.invalid(key, value, f"a path whose variables are set: {err}") from None
        if must_exist and not os.path.exists(path):
            hint = f"; set {MODELS_DIR_VARIABLE} to the directory holding it" if MODELS_DIR_VARIABLE in value else ""
            raise self.invalid(key, value, f"an existing path (absolute or relative to {self._base_dir}; it is {path}){hint}")
        return path

    def check_all_read(self) -> None:
        unknown = sorted(set(self._raw) - self._read)
        if unknown:
            raise ParameterError(
                f"{self._component}: unknown parameter(s) {unknown}; allowed: {sorted(self._read)}"
            )


def _range_text(minimum: float | None, maximum: float | None) -> str:
    texts = {(True, True): f" in [{minimum}, {maximum}]", (True, False): f" >= {minimum}", (False, True): f" <= {maximum}"}
    return texts.get((minimum is not None, maximum is not None), "")


def instance_device(args: Mapping[str, Any]) -> str:
    """The torch device of this model instance: ``cuda:<id>`` for a GPU instance, else ``cpu``."""
    if args.get("model_instance_kind") == "GPU":
        return f"cuda:{int(args.get('model_instance_device_id', 0))}"
    return "cpu"


# --- request tensors ---------------------------------------------------------------------------


class RequestError(ValueError):
    """A request input is missing or invalid; answered with an error response naming the input."""


class ServingError(RuntimeError):
    """The repository's models do not fit together (e.g. draft and target vocabularies); no request can run."""


class BlsError(RuntimeError):
    """A composing model answered a BLS request with an error; ``code`` is its TritonError code."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


CANCEL_CHECK_INTERVAL_S = 0.02  # how stale a request's cancelled flag may be: at most ~one step of work wasted


def cancellation_check(request, interval_s: float = CANCEL_CHECK_INTERVAL_S) -> Callable[[], bool]:
    """``request.is_cancelled``, asked of the server at most every ``interval_s``.

    In the Python backend ``is_cancelled()`` is a round trip to the server process, and
    the scheduler asks before every step for every live sequence, so unthrottled it adds
    one round trip per sequence to every step. Once cancelled, always cancelled.
    """
    last_asked, cancelled = float("-inf"), False

    def is_cancelled() -> bool:
        nonlocal last_asked, cancelled
        now = time.monotonic()
        if not cancelled and now - last_asked >= interval_s:
            last_asked, cancelled = now, request.is_cancelled()
        return cancelled

    return is_cancelled


def request_inputs(request, names: Iterable[str]) -> dict[str, np.ndarray]:
    """The named inputs present in a Triton request, as numpy arrays (absent optional inputs are left out).

    One pass over the request's tensors: ``pb_utils.get_input_tensor_by_name`` walks (and
    wraps) all of them again for each name asked, and a verify request is asked for 25.
    """
    wanted = set(names)
    return {tensor.name(): tensor.as_numpy() for tensor in request.inputs() if tensor.name() in wanted}


def scalar(inputs: Mapping[str, np.ndarray], name: str, kind: type, default=None):
    """One value of a ``[1]``-shaped input as ``kind`` (int, float, bool); ``default`` when absent."""
    if name not in inputs:
        return default
    values = np.asarray(inputs[name]).reshape(-1)
    if values.size != 1:
        raise RequestError(f"input '{name}' must hold exactly one value, got shape {list(inputs[name].shape)}")
    value = values[0]
    if kind is float and not np.isfinite(value):
        raise RequestError(f"input '{name}' must be a finite number, got {value}")
    return kind(value)


def text(inputs: Mapping[str, np.ndarray], name: str, default: str | None = None) -> str | None:
    values = texts(inputs, name)
    if values is None:
        return default
    if len(values) != 1:
        raise RequestError(f"input '{name}' must hold exactly one string, got {len(values)}")
    return values[0]


def texts(inputs: Mapping[str, np.ndarray], name: str) -> list[str] | None:
    """A BYTES input as strings; invalid UTF-8 is a request error naming the input."""
    if name not in inputs:
        return None
    out = []
    for item in np.asarray(inputs[name]).reshape(-1):
        try:
            out.append(item.decode("utf-8") if isinstance(item, bytes) else str(item))
        except UnicodeDecodeError as err:
            raise RequestError(f"input '{name}' is not valid UTF-8: {err}") from None
    return out


def bytes_array(values: Sequence[str]) -> np.ndarray:
    return np.array([value.encode("utf-8") for value in values], dtype=np.object_)


def make_response(outputs: Mapping[str, np.ndarray]):
    pb_utils = triton_utils()
    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, array) for name, array in outputs.items()])


def error_response(err: Exception):
    """An error response whose code follows the exception: invalid input, cancelled, or internal."""
    pb_utils = triton_utils()
    if isinstance(err, SequenceCancelled):
        code, message = pb_utils.TritonError.CANCELLED, str(err)
    elif isinstance(err, ServingError):
        code, message = pb_utils.TritonError.UNAVAILABLE, str(err)
    elif isinstance(err, BlsError):
        code, message = err.code, str(err)
    elif isinstance(err, ValueError):
        code, message = pb_utils.TritonError.INVALID_ARG, str(err)
    else:
        code, message = pb_utils.TritonError.INTERNAL, f"{type(err).__name__}: {err}"
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))


Handler = Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]]
BatchHandler = Callable[[list[dict[str, np.ndarray]]], list[Mapping[str, np.ndarray]]]


def answer(requests, input_names: Iterable[str], handler: Handler) -> list:
    """One response per request: ``handler``'s outputs for its inputs, or an error response."""
    names = list(input_names)
    return [_respond(_outcome(handler, request_inputs(request, names))) for request in requests]


def answer_batch(requests, input_names: Iterable[str], handler: BatchHandler) -> list:
    """Answer a dynamic batch (``max_batch_size > 0``, one item per request) with one ``handler`` call.

    Each request's tensors lose their leading batch dimension on the way in and get it
    back on the way out. When the batch fails, every request is retried alone, so
    one bad request gets its own error and the others their results.
    """
    names = list(input_names)
    batch = [{name: array[0] for name, array in request_inputs(request, names).items()} for request in requests]
    results = run_batch(batch, handler)
    return [_respond(r if isinstance(r, Exception) else {name: a[None] for name, a in r.items()}) for r in results]


def _respond(result: Mapping[str, np.ndarray] | Exception):
    return error_response(result) if isinstance(result, Exception) else make_response(result)


def run_batch(items: list, handler: Callable[[list], list]) -> list:
    """``handler(items)``; if that raises, ``handler([item])`` for each item, exceptions kept as results."""
    try:
        return handler(items)
    except Exception as err:
        if len(items) == 1:
            return [err]
        return [_outcome(lambda item: handler([item])[0], item) for item in items]


def _outcome(function: Callable, argument):
    """``function(argument)``, or the exception it raised: reported in that request's own response."""
    try:
        return function(argument)
    except Exception as err:
        return err


# --- logging -----------------------------------------------------------------------------------


class ModelLogger:
    """Log lines prefixed ``[specdec:<model>]``: to Triton's log in a stub, else to ``logging``."""

    def __init__(self, model_name: str):
        self.prefix = f"[specdec:{model_name}] "
        try:
            self._logger = triton_utils().Logger
        except ImportError:
            self._logger = None
            self._fallback = logging.getLogger(f"specdec_triton.{model_name}")

    def info(self, message: str) -> None:
        self._emit("log_info", logging.INFO, message)

    def warning(self, message: str) -> None:
        self._emit("log_warn", logging.WARNING, message)

    def error(self, message: str) -> None:
        self._emit("log_error", logging.ERROR, message)

    def _emit(self, triton_method: str, level: int, message: str) -> None:
        if self._logger is not None:
            getattr(self._logger, triton_method)(self.prefix + message)
        else:
            self._fallback.log(level, self.prefix + message)
