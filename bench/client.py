"""Closed-loop streaming load against the orchestrator model over gRPC.

``concurrency`` workers each keep one request in flight; every request is its own
bidirectional stream with ``enable_empty_final_response``, so the client knows
when a request is over without counting tokens. Arrival times are read when each
response reaches the client.
"""
from __future__ import annotations

import asyncio
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import tritonclient.grpc.aio as grpcclient_aio
from tritonclient.grpc import InferInput

from bench.stats import RequestTiming
from bench.workload import Prompt

# Tensor names of the orchestrator model (model_repository/speculative_decoding/config.pbtxt).
PROMPT_INPUT = "text_input"
STREAM_INPUT = "stream"
MAX_TOKENS_INPUT = "max_tokens"
MIN_TOKENS_INPUT = "min_tokens"
TEMPERATURE_INPUT = "temperature"
SEED_INPUT = "seed"
K_INPUT = "num_speculative_tokens"
GUIDE_TYPE_INPUT, GUIDE_INPUT = "guided_decoding_guide_type", "guided_decoding_guide"
TEXT_OUTPUT = "text_output"  # streamed: each response carries the new text
NUM_OUTPUT_TOKENS = "num_output_tokens"  # cumulative: a response carries the difference
ACCEPTED_OUTPUT = "total_accepted_draft_tokens"
DRAFTED_OUTPUT = "total_draft_tokens"

_NUMPY_TYPES = {"INT32": np.int32, "INT64": np.int64, "UINT64": np.uint64, "FP32": np.float32, "BOOL": np.bool_,
                "BYTES": np.object_}


@dataclass(frozen=True)
class Job:
    prompt: Prompt
    max_tokens: int
    num_speculative_tokens: int | None  # None: the server's configured k
    ignore_eos: bool  # min_tokens = max_tokens, so every request emits exactly max_tokens
    temperature: float = 0.0  # above 0: sampled, seeded from the prompt's text (the same seed on every server)
    guide: str | None = None  # a JSON schema the output follows (guided_decoding_guide); None: free text


@dataclass
class JobResult:
    timing: RequestTiming
    text: str  # the streamed pieces joined: the whole output text
    accepted: int | None  # the request's accepted draft tokens, when the server reports them
    drafted: int | None


def _tensor(name: str, values: list, datatypes: dict[str, str]) -> InferInput:
    if name not in datatypes:
        raise KeyError(f"the model has no input {name!r}; it has {sorted(datatypes)}")
    datatype = datatypes[name]
    array = np.asarray(values, dtype=_NUMPY_TYPES[datatype])
    tensor = InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


def build_inputs(job: Job, datatypes: dict[str, str]) -> list[InferInput]:
    """The request tensors; ``datatypes`` (input name -> Triton datatype) comes from the model metadata."""
    inputs = [
        _tensor(PROMPT_INPUT, [job.prompt.text.encode()], datatypes),
        _tensor(STREAM_INPUT, [True], datatypes),
        _tensor(MAX_TOKENS_INPUT, [job.max_tokens], datatypes),
    ]
    if job.ignore_eos:
        inputs.append(_tensor(MIN_TOKENS_INPUT, [job.max_tokens], datatypes))
    if job.num_speculative_tokens is not None:
        inputs.append(_tensor(K_INPUT, [job.num_speculative_tokens], datatypes))
    if job.guide is not None:
        inputs.append(_tensor(GUIDE_TYPE_INPUT, [b"json_schema"], datatypes))
        inputs.append(_tensor(GUIDE_INPUT, [job.guide.encode()], datatypes))
    if job.temperature > 0:
        inputs.append(_tensor(TEMPERATURE_INPUT, [job.temperature], datatypes))
        inputs.append(_tensor(SEED_INPUT, [zlib.crc32(job.prompt.text.encode())], datatypes))
    return inputs


async def _one(client, model: str, job: Job, datatypes: dict[str, str], request_id: str) -> JobResult:
    async def requests():
        yield {"model_name": model, "inputs": build_inputs(job, datatypes), "request_id": request_id,
               "enable_empty_final_response": True}

    timing = RequestTiming(sent=time.perf_counter())
    num_tokens = 0
    pieces: list[str] = []
    accepted = drafted = None
    async for result, error in client.stream_infer(requests()):
        now = time.perf_counter()
        if error is not None:
            raise RuntimeError(f"request {request_id}: {error}")
        if (piece := result.as_numpy(TEXT_OUTPUT)) is not None:
            pieces.extend(p.decode() for p in piece.reshape(-1))
        if (n := result.as_numpy(NUM_OUTPUT_TOKENS)) is not None:
            total = int(n.reshape(-1)[0])
            timing.record(now, total - num_tokens)
            num_tokens = total
        if (a := result.as_numpy(ACCEPTED_OUTPUT)) is not None:
            accepted = int(a.reshape(-1)[0])
        if (d := result.as_numpy(DRAFTED_OUTPUT)) is not None:
            drafted = int(d.reshape(-1)[0])
        if result.get_response().parameters["triton_final_response"].bool_param:
            break
    return JobResult(timing, "".join(pieces), accepted, drafted)


async def _run(url: str, model: str, jobs: list[Job], concurrency: int, on_done: Callable[[], None]):
    client = grpcclient_aio.InferenceServerClient(url)
    try:
        metadata = await client.get_model_metadata(model, as_json=True)
        datatypes = {t["name"]: t["datatype"] for t in metadata["inputs"]}
        queue: asyncio.Queue = asyncio.Queue()
        for i, job in enumerate(jobs):
            queue.put_nowait((i, job))
        results: list[JobResult | None] = [None] * len(jobs)

        async def worker() -> None:
            while not queue.empty():
                i, job = queue.get_nowait()
                results[i] = await _one(client, model, job, datatypes, f"bench-{i}")
                on_done()

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return results, time.perf_counter() - started
    finally:
        await client.close()


def run_load(
    url: str, model: str, jobs: list[Job], concurrency: int, on_done: Callable[[], None] = lambda: None
) -> tuple[list[JobResult], float]:
    """Send ``jobs`` with ``concurrency`` in flight; return the results in job order and the wall time (s)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    return asyncio.run(_run(url, model, jobs, concurrency, on_done))
