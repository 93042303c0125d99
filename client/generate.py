"""Command-line client for the speculative-decoding server: prompt in, text and acceptance figures out.

    python -m client.generate "Once upon a time" --max-tokens 64 --num-speculative-tokens 4
    python -m client.generate "Once upon a time" --protocol http --no-stream --temperature 0.8 --seed 1

gRPC goes through ``tritonclient.grpc`` and its bidirectional stream (the models are
decoupled, so this is how both streamed and single responses arrive). HTTP uses
Triton's generate extension (``/generate`` and ``/generate_stream``, server-sent
events) with the standard library: ``tritonclient.http`` cannot call decoupled models.
Over gRPC the tensors get the leading batch dimension of 1 that a model with
``max_batch_size > 0`` (``ensemble``, as TensorRT-LLM's) expects, read once from its config.
"""
from __future__ import annotations

import argparse
import json
import queue
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

# Public inputs and their Triton datatypes; a value of None is not sent.
INPUT_TYPES = {
    "text_input": "BYTES", "max_tokens": "INT32", "stream": "BOOL", "temperature": "FP32", "top_p": "FP32",
    "top_k": "INT32", "min_p": "FP32", "seed": "UINT64", "stop_words": "BYTES", "end_id": "INT32", "min_tokens": "INT32",
    "exclude_input_in_output": "BOOL", "num_speculative_tokens": "INT32", "bad_words": "BYTES",
    "repetition_penalty": "FP32", "presence_penalty": "FP32", "frequency_penalty": "FP32", "return_log_probs": "BOOL",
    "beam_width": "INT32", "random_seed": "UINT64", "min_length": "INT32",
    "guided_decoding_guide_type": "BYTES", "guided_decoding_guide": "BYTES",
}  # fmt: skip
_NUMPY = {"BYTES": np.object_, "INT32": np.int32, "FP32": np.float32, "UINT64": np.uint64, "BOOL": np.bool_}
COUNTS = ("num_input_tokens", "num_output_tokens", "total_accepted_draft_tokens", "total_draft_tokens")


class GenerateError(RuntimeError):
    """The server answered with an error."""


@dataclass
class Result:
    chunks: list[str] = field(default_factory=list)  # text_output of each response, in order
    finish_reason: str = ""
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    acceptance_rate: float = 0.0
    total_accepted_draft_tokens: int = 0
    total_draft_tokens: int = 0
    seconds: float = 0.0
    first_chunk_seconds: float | None = None
    output_log_probs: list[float] = field(default_factory=list)  # return_log_probs: one per output token
    cum_log_prob: float = 0.0

    @property
    def text(self) -> str:
        return "".join(self.chunks)

    def add(self, outputs: dict, started: float) -> None:
        """Fold one response (output name -> value) into the result; counts are cumulative."""
        self.chunks.append(outputs["text_output"])
        if self.first_chunk_seconds is None:
            self.first_chunk_seconds = time.perf_counter() - started
        self.finish_reason = outputs.get("finish_reason", "") or self.finish_reason
        for name in COUNTS:
            setattr(self, name, int(outputs.get(name, 0)))
        self.acceptance_rate = float(outputs.get("acceptance_rate", 0.0))
        if "output_log_probs" in outputs:  # the response's new tokens; [1, tokens] or a JSON list or number
            self.output_log_probs += np.ravel(np.asarray(outputs["output_log_probs"], dtype=np.float64)).tolist()
            self.cum_log_prob = float(np.ravel(outputs["cum_log_probs"])[0])


def _request_values(prompt: str, params: dict) -> dict:
    values = {"text_input": prompt, **{k: v for k, v in params.items() if v is not None}}
    unknown = set(values) - set(INPUT_TYPES)
    if unknown:
        raise ValueError(f"unknown request parameter(s) {sorted(unknown)}; known: {sorted(INPUT_TYPES)}")
    return values


def _scalar(value) -> object:
    if isinstance(value, np.ndarray):
        value = value.reshape(-1)
        value = value[0] if value.size == 1 else value.tolist()
    if isinstance(value, bytes):
        return value.decode("utf-8")
    return value.item() if isinstance(value, np.generic) else value


def grpc_inputs(prompt: str, params: dict) -> list:
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, value in _request_values(prompt, params).items():
        datatype = INPUT_TYPES[name]
        values = value if isinstance(value, (list, tuple)) else [value]
        if datatype == "BYTES":
            values = [v.encode("utf-8") if isinstance(v, str) else v for v in values]
        array = np.array(values, dtype=_NUMPY[datatype])
        tensor = grpcclient.InferInput(name, list(array.shape), datatype)
        tensor.set_data_from_numpy(array)
        inputs.append(tensor)
    return inputs


def generate_grpc(
    url: str,
    model: str,
    prompt: str,
    params: dict,
    on_chunk: Callable[[str], None] | None = None,
) -> Result:
    """One request over a gRPC stream; ``params['stream']`` decides one response or one per step."""
    return grpc_stream(url, model, grpc_inputs(prompt, params), on_chunk)


def grpc_stream(url: str, model: str, inputs: list, on_chunk: Callable[[str], None] | None = None) -> Result:
    """Send ``inputs`` (``tritonclient.grpc.InferInput``s) on a gRPC stream and collect the responses."""
    import tritonclient.grpc as grpcclient
    from tritonclient.utils import InferenceServerException

    client = grpcclient.InferenceServerClient(url)
    try:
        batched = _takes_batch_dimension(client, url, model)
    except InferenceServerException as err:  # e.g. the model is not loaded (now)
        client.close()
        raise GenerateError(str(err)) from None
    if batched:
        for tensor in inputs:
            tensor.set_shape([1, *tensor.shape()])
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    result, started = Result(), time.perf_counter()
    try:
        try:
            client.async_stream_infer(model, inputs, enable_empty_final_response=True)
        except InferenceServerException as err:  # the stream ended before the request went out: its reason is queued
            _, error = responses.get(timeout=5) if not responses.empty() else (None, err)
            raise GenerateError(str(error or err)) from None
        while True:
            response, error = responses.get()
            if error is not None:
                raise GenerateError(str(error))
            raw = response.get_response()
            if raw.outputs:
                outputs = {out.name: response.as_numpy(out.name) if out.name == "output_log_probs"
                           else _scalar(response.as_numpy(out.name)) for out in raw.outputs}  # fmt: skip
                result.add(outputs, started)
                if on_chunk:
                    on_chunk(outputs["text_output"])
            if raw.parameters["triton_final_response"].bool_param:
                break
    finally:
        client.stop_stream()
        client.close()
    result.seconds = time.perf_counter() - started
    return result


_max_batch_size: dict[tuple[str, str], int] = {}  # (url, model) -> its max_batch_size


def _takes_batch_dimension(client, url: str, model: str) -> bool:
    if (url, model) not in _max_batch_size:
        _max_batch_size[url, model] = client.get_model_config(model).config.max_batch_size
    return _max_batch_size[url, model] > 0


def generate_http(
    url: str, model: str, prompt: str, params: dict, on_chunk: Callable[[str], None] | None = None
) -> Result:
    """One request through the generate extension: ``/generate_stream`` when streaming, else ``/generate``."""
    values = _request_values(prompt, params)
    stream = bool(values.get("stream"))
    endpoint = "generate_stream" if stream else "generate"
    request = urllib.request.Request(
        f"http://{url}/v2/models/{model}/{endpoint}",
        data=json.dumps(values).encode("utf-8"),
        headers={"Content-Type": "application/json"},
    )
    result, started = Result(), time.perf_counter()
    try:
        with urllib.request.urlopen(request) as response:
            lines = (line.decode("utf-8").strip() for line in response) if stream else [response.read().decode()]
            for line in lines:
                if stream and not line.startswith("data:"):
                    continue
                outputs = json.loads(line[len("data:") :] if stream else line)
                if "error" in outputs:
                    raise GenerateError(outputs["error"])
                result.add(outputs, started)
                if on_chunk:
                    on_chunk(outputs["text_output"])
    except urllib.error.HTTPError as err:
        raise GenerateError(_http_error_message(err)) from None
    result.seconds = time.perf_counter() - started
    return result


def _http_error_message(err: urllib.error.HTTPError) -> str:
    """The server's message from an error body: JSON, or one server-sent event holding JSON."""
    body = err.read().decode("utf-8", errors="replace").strip()
    body = body[len("data:") :] if body.startswith("data:") else body
    try:
        return json.loads(body).get("error", body)
    except json.JSONDecodeError:
        return body or str(err)


def reachable(url: str, timeout_s: float = 2.0) -> bool:
    """Whether anything accepts a TCP connection at ``host:port``."""
    host, _, port = url.rpartition(":")
    try:
        with socket.create_connection((host or "localhost", int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prompt")
    parser.add_argument("--protocol", choices=("grpc", "http"), default="grpc")
    parser.add_argument("--url", help="host:port (default localhost:8001 for gRPC, localhost:8000 for HTTP)")
    parser.add_argument("--model", default="ensemble", help="ensemble, or speculative_decoding (cancellable)")
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--min-tokens", type=int)
    parser.add_argument("--temperature", type=float, help="0 or absent: greedy")
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--min-p", type=float, help="drop tokens under min_p x the likeliest's probability")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", dest="stop_words", help="a stop word; repeatable")
    parser.add_argument("--end-id", type=int)
    parser.add_argument("--num-speculative-tokens", type=int, help="per-request k; 0: no speculation")
    parser.add_argument("--exclude-input", action="store_true", help="non-streaming: leave the prompt out")
    parser.add_argument("--bad-word", action="append", dest="bad_words", help="a word never to output; repeatable")
    parser.add_argument("--repetition-penalty", type=float, help="> 1 discourages repeating context tokens")
    parser.add_argument("--presence-penalty", type=float)
    parser.add_argument("--frequency-penalty", type=float)
    parser.add_argument("--log-probs", action="store_true", help="print the output's summed log probability")
    parser.add_argument("--no-stream", dest="stream", action="store_false")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    params = {
        "max_tokens": args.max_tokens, "min_tokens": args.min_tokens, "temperature": args.temperature,
        "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p, "seed": args.seed, "stop_words": args.stop_words,
        "end_id": args.end_id, "num_speculative_tokens": args.num_speculative_tokens, "stream": args.stream,
        "exclude_input_in_output": args.exclude_input or None, "bad_words": args.bad_words,
        "repetition_penalty": args.repetition_penalty, "presence_penalty": args.presence_penalty,
        "frequency_penalty": args.frequency_penalty, "return_log_probs": args.log_probs or None,
    }  # fmt: skip

    def print_chunk(text: str) -> None:
        print(text, end="", flush=True)

    url = args.url or ("localhost:8001" if args.protocol == "grpc" else "localhost:8000")
    call = generate_grpc if args.protocol == "grpc" else generate_http
    try:
        result = call(url, args.model, args.prompt, params, print_chunk)
    except Exception as err:
        if not reachable(url):
            print(f"error: no server answers at {url} ({args.protocol}); start one with scripts/serve.sh, "
                  "or give its address with --url HOST:PORT", file=sys.stderr)  # fmt: skip
            return 1
        if isinstance(err, GenerateError):
            print(f"error: {err}", file=sys.stderr)
            return 1
        raise
    print()
    print(
        f"[{result.finish_reason}] {result.num_input_tokens} input + {result.num_output_tokens} output tokens "
        f"in {result.seconds:.3f} s (first text after {result.first_chunk_seconds or 0:.3f} s); "
        f"acceptance {result.acceptance_rate:.3f} "
        f"({result.total_accepted_draft_tokens}/{result.total_draft_tokens} draft tokens)"
        + (f"; log probability {result.cum_log_prob:.3f}" if args.log_probs else ""),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
