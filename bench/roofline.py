"""The memory-bandwidth floor of a decode or verify step.

A step of a few tokens multiplies every weight matrix by a handful of rows, so it
reads all of the weights once and does little arithmetic with each byte: its time is
bounded below by ``weight bytes / memory bandwidth`` (the roofline model's
memory-bound side; Williams et al. 2009). How close the verify step comes to that
floor is the engine's efficiency, independent of how well the drafts are accepted.
"""
from __future__ import annotations

import statistics
import time

import torch
from torch import nn

from bench.bound import synchronize

DEFAULT_BUFFER_MB = {"cuda": 1024, "cpu": 256}  # well above any cache on either


def weight_bytes_per_step(model: nn.Module) -> int:
    """Bytes of weights one forward reads: every parameter once, except an untied input embedding.

    The input embedding is a table lookup (a few rows per step); with tied embeddings
    the same matrix is read in full by the output projection, so it counts once.
    ``parameters()`` already yields a tied matrix once.
    """
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    tied = output is not None and output.weight.data_ptr() == embedding.data_ptr()
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    return total if tied else total - embedding.numel() * embedding.element_size()


def memory_bandwidth_gbps(
    device: str | torch.device, buffer_mb: int | None = None, repeats: int = 10, warmup: int = 2
) -> float:
    """Measured copy bandwidth of ``device`` (GB/s, 1e9 bytes): a buffer's bytes read plus written, per second.

    A device-to-device copy of a buffer much larger than the caches is what streaming
    weights costs; the median of ``repeats`` copies is taken.
    """
    device = torch.device(device)
    size_mb = buffer_mb if buffer_mb is not None else DEFAULT_BUFFER_MB.get(device.type, 256)
    if size_mb < 1 or repeats < 1 or warmup < 0:
        raise ValueError(f"buffer_mb and repeats must be >= 1 and warmup >= 0, got {size_mb}, {repeats}, {warmup}")
    source = torch.empty(size_mb * 2**20, dtype=torch.uint8, device=device).fill_(1)
    target = torch.empty_like(source)
    times = []
    for i in range(warmup + repeats):
        synchronize(device)
        start = time.perf_counter()
        target.copy_(source)
        synchronize(device)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return 2 * source.numel() / statistics.median(times) / 1e9


def floor_ms(weight_bytes: int, bandwidth_gbps: float) -> float:
    """The least time (ms) a step can take that reads ``weight_bytes`` at ``bandwidth_gbps``."""
    if weight_bytes < 0 or bandwidth_gbps <= 0:
        raise ValueError(f"weight_bytes must be >= 0 and bandwidth > 0, got {weight_bytes} and {bandwidth_gbps}")
    return 1e3 * weight_bytes / (bandwidth_gbps * 1e9)


def target_over_floor(weight_bytes: int, bandwidth_gbps: float, step_times_ms: dict[str, float]) -> dict:
    """The floor of a target step and each measured ``target_*`` step time as a multiple of it."""
    floor = floor_ms(weight_bytes, bandwidth_gbps)
    return {
        "target_weight_bytes": weight_bytes,
        "bandwidth_gbps": bandwidth_gbps,
        "floor_ms": floor,
        "over_floor": {name: ms / floor for name, ms in step_times_ms.items() if name.startswith("target_")},
    }
