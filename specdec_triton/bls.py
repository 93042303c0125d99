"""BLS requests from one model to another: the async form the orchestrator awaits, and the
blocking form a model's ``execute`` uses (the draft proposer and the target verifier
sending to rejection_sampler). Both build the request and read the response alike.
"""
from __future__ import annotations

import asyncio
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from specdec_triton.plumbing import BlsError, triton_utils

__all__ = ["BlsError", "bls", "bls_blocking", "ensure_bls_threads"]


def _request(model_name: str, inputs: Mapping[str, np.ndarray], output_names: Sequence[str], batched: bool):
    pb_utils = triton_utils()
    return pb_utils.InferenceRequest(
        model_name=model_name,
        inputs=[pb_utils.Tensor(name, array[None] if batched else array) for name, array in inputs.items()],
        requested_output_names=list(output_names),
    )


def _outputs(response, model_name: str, output_names: Sequence[str], batched: bool) -> dict[str, np.ndarray]:
    if response.has_error():
        raise BlsError(f"{model_name}: {response.error().message()}", response.error().code())
    tensors = {tensor.name(): tensor for tensor in response.output_tensors()}  # one pass, not one per name
    missing = [name for name in output_names if name not in tensors]
    if missing:
        raise RuntimeError(f"{model_name}: the response lacks the requested output(s) {missing}")
    outputs = {name: tensors[name].as_numpy() for name in output_names}
    return {name: array[0] for name, array in outputs.items()} if batched else outputs


async def bls(
    model_name: str,
    inputs: Mapping[str, np.ndarray],
    output_names: Sequence[str],
    batched: bool = False,
) -> dict[str, np.ndarray]:
    """One BLS request to ``model_name``; returns the requested outputs as numpy arrays.

    ``batched``: the model has ``max_batch_size > 0``, so this request is one batch item.
    """
    response = await _request(model_name, inputs, output_names, batched).async_exec()
    return _outputs(response, model_name, output_names, batched)


def bls_blocking(model_name: str, inputs: Mapping[str, np.ndarray], output_names: Sequence[str]) -> dict[str, np.ndarray]:
    """``bls`` for a caller with no event loop (a model's ``execute``): waits for the answer."""
    return _outputs(_request(model_name, inputs, output_names, False).exec(), model_name, output_names, False)


def ensure_bls_threads(num_threads: int) -> None:
    """Give the running event loop a default executor of at least ``num_threads`` threads.

    ``async_exec`` waits for each BLS response on a thread of the loop's default executor,
    whose size is ``min(32, cpus + 4)`` -- 6 on a 2-core machine. With more requests in
    flight than threads, the rest queue in the executor instead of at the model, where
    they could have joined a dynamic batch.
    """
    loop = asyncio.get_running_loop()
    if num_threads > _bls_threads.get(loop, 0):
        loop.set_default_executor(ThreadPoolExecutor(max_workers=num_threads, thread_name_prefix="specdec-bls"))
        _bls_threads[loop] = num_threads


_bls_threads: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> its executor's threads
