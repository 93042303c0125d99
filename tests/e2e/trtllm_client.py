"""A client written the way TensorRT-LLM's ``inflight_batcher_llm/client/end_to_end_grpc_client.py`` is.

Every tensor carries a leading batch dimension of 1 (``[[prompt]]``, ``[[max_tokens]]``),
``beam_width`` is always sent, the penalties, ``bad_words`` and ``return_log_probs`` go
under TensorRT-LLM's names, and the responses are read from one gRPC stream that the
client opens, sends on and closes (``start_stream``, ``async_stream_infer``,
``stop_stream``). ``batch_dim=False`` sends the same tensors without the batch
dimension, as ``speculative_decoding`` takes them.
"""
from __future__ import annotations

import queue
from dataclasses import dataclass, field

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, np_to_triton_dtype


def prepare_tensor(name: str, array: np.ndarray) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
    tensor.set_data_from_numpy(array)
    return tensor


def prepare_inputs(
    prompt: str,
    output_len: int,
    beam_width: int = 1,
    temperature: float | None = None,
    streaming: bool = False,
    repetition_penalty: float | None = None,
    presence_penalty: float | None = None,
    frequency_penalty: float | None = None,
    stop_words: list[str] | None = None,
    bad_words: list[str] | None = None,
    return_log_probs: bool | None = None,
    random_seed: int | None = None,
    end_id: int | None = None,
    pad_id: int | None = None,
    exclude_input_in_output: bool | None = None,
    extra: dict[str, np.ndarray] | None = None,  # any other input, already batched ([1, ...])
) -> dict[str, np.ndarray]:
    """The tensors of one request, each ``[1, ...]``, as TensorRT-LLM's client prepares them."""
    inputs = {
        "text_input": np.array([[prompt]]).astype(object),
        "max_tokens": np.array([[output_len]], dtype=np.int32),
        "stream": np.array([[streaming]], dtype=bool),
        "beam_width": np.array([[beam_width]], dtype=np.int32),
    }
    scalars = {
        "temperature": (temperature, np.float32), "repetition_penalty": (repetition_penalty, np.float32),
        "presence_penalty": (presence_penalty, np.float32), "frequency_penalty": (frequency_penalty, np.float32),
        "return_log_probs": (return_log_probs, bool), "random_seed": (random_seed, np.uint64),
        "end_id": (end_id, np.int32), "pad_id": (pad_id, np.int32),
        "exclude_input_in_output": (exclude_input_in_output, bool),
    }  # fmt: skip
    for name, (value, dtype) in scalars.items():
        if value is not None:
            inputs[name] = np.array([[value]], dtype=dtype)
    for name, words in (("stop_words", stop_words), ("bad_words", bad_words)):
        if words:
            inputs[name] = np.array([words], dtype=object)
    inputs.update(extra or {})
    return inputs


@dataclass
class Output:
    text: str = ""  # streamed pieces concatenated, or the one response's text
    responses: int = 0
    output_log_probs: list[float] = field(default_factory=list)  # every response's, concatenated
    cum_log_probs: float | None = None  # the last response's


def run_inference(url: str, model: str, inputs: dict[str, np.ndarray], batch_dim: bool = True) -> Output:
    """One request on its own stream; raises the server's error, if it sent one."""
    if not batch_dim:
        inputs = {name: array[0] for name, array in inputs.items()}
    outputs = [grpcclient.InferRequestedOutput(name) for name in ("text_output", "cum_log_probs", "output_log_probs")]
    completed: queue.Queue = queue.Queue()
    client = grpcclient.InferenceServerClient(url=url)
    client.start_stream(callback=lambda result, error: completed.put(error or result))
    try:
        client.async_stream_infer(model, [prepare_tensor(k, v) for k, v in inputs.items()], outputs=outputs)
    finally:
        client.stop_stream()  # waits for the server to close the stream
        client.close()
    output = Output()
    while not completed.empty():
        result = completed.get()
        if isinstance(result, InferenceServerException):
            raise result
        output.responses += 1
        output.text += result.as_numpy("text_output").reshape(-1)[0].decode("utf-8")
        log_probs = result.as_numpy("output_log_probs")  # [1, beams, tokens] with the batch dimension
        assert log_probs.shape[-2] == 1 and log_probs.ndim == (3 if batch_dim else 2), log_probs.shape
        output.output_log_probs += log_probs.reshape(-1).tolist()
        output.cum_log_probs = float(result.as_numpy("cum_log_probs").reshape(-1)[0])
    return output
