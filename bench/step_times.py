"""In-process timings for the served benchmark's bound, taken on the engine each server model runs.

The step times (target and draft forwards, each served head's k-draft proposal), the
target's memory-bandwidth floor, and eager step times where the server does better (CUDA
graphs or ``cpu_compile``), read from the repository's ``config.pbtxt`` files as the
models read them.
"""
from __future__ import annotations

from pathlib import Path

from bench.bound import forward_ms, head_propose_ms
from bench.phase import PROPOSER_MODEL, TARGET_MODEL
from bench.repository import get_parameters, method_of
from bench.results import step_time_keys
from bench.roofline import memory_bandwidth_gbps, target_over_floor, weight_bytes_per_step
from specdec.fast import FastCausalLM
from specdec.heads import HEAD_METHODS
from specdec.methods import METHODS
from specdec_triton.plumbing import Parameters


def server_parameter(repository: Path, model: str, key: str, default: str) -> str:
    config = repository / model / "config.pbtxt"
    return get_parameters(config.read_text()).get(key, default) if config.is_file() else default


def measure_step_times(args, target, draft, dtype: str, device: str, cuda_graphs: bool | None = None,
                       compiled: bool = True) -> dict:
    """Median forward times (ms) on a cache of prompt + max_tokens / 2 tokens, in this process, and each
    served head's k-draft proposal.

    Timed on the engine each server model runs (``engine`` and ``cpu_compile`` in its
    config.pbtxt), so the analytic bound is that of the serving path; the ``hf`` engine
    reuses the loaded models. ``cuda_graphs``: that of the fast engine (None: on where CUDA
    is, as in the server); ``compiled`` False: eager even where the server compiles.
    """
    context = args.prompt_tokens + args.max_tokens // 2
    models = {}
    for role, model_name, hf_model, path in (("target", TARGET_MODEL, target, args.target),
                                              ("draft", PROPOSER_MODEL, draft, args.draft)):
        engine = server_parameter(args.repository, model_name, "engine", "fast")
        cpu_compile = compiled and device == "cpu" and server_compiles(args.repository, model_name)
        models[role] = (FastCausalLM(path, dtype, device, max_num_seqs=len(args.ks) + 1, max_model_len=context + 16,
                                     cuda_graphs=cuda_graphs, cpu_compile=cpu_compile)
                        if engine == "fast" else hf_model)
    shapes = {name: (models["draft" if name.startswith("draft") else "target"], n)
              for name, n in step_time_keys(args.ks)}  # fmt: skip
    times = forward_ms(shapes, context, repeats=args.timing_repeats, seed=args.seed)
    head_compiles = compiled and device == "cpu" and server_compiles(args.repository, PROPOSER_MODEL)
    for method in sorted({method_of(m) for m in args.methods} & set(HEAD_METHODS)):  # a head's own proposal
        head = args.target if METHODS[method].in_target_checkpoint else getattr(args, method)  # MTP: the target's own
        times.update(head_propose_ms(method, head, args.target, target.config.hidden_size, args.ks,
                                     dtype, device, head_compiles, cuda_graphs, context, args.timing_repeats,
                                     target_lm=models["target"]))  # fmt: skip
    return times


def server_compiles(repository, model_name: str) -> bool:
    """The model's ``cpu_compile``, read as the model reads it."""
    value = server_parameter(repository, model_name, "cpu_compile", "false")
    return Parameters({"cpu_compile": value}, component=model_name).get_bool("cpu_compile", False)


def in_process_timings(args, target, draft, dtype: str, device: str) -> tuple[dict, dict, dict | None, list[str]]:
    """Step times, the target's memory-bandwidth floor and eager step times where the server does
    better (CUDA graphs, or ``cpu_compile``); and a line on each."""
    step_times = measure_step_times(args, target, draft, dtype, device)
    roofline = target_over_floor(weight_bytes_per_step(target), memory_bandwidth_gbps(device), step_times)
    eager, faster_by = None, None
    if server_parameter(args.repository, TARGET_MODEL, "engine", "fast") == "fast":
        if device == "cuda":
            eager, faster_by = measure_step_times(args, target, draft, dtype, device, cuda_graphs=False), "CUDA graphs"
        elif server_compiles(args.repository, TARGET_MODEL):
            eager, faster_by = measure_step_times(args, target, draft, dtype, device, compiled=False), "cpu_compile"
    notes = [
        "Step times (ms, median, in-process): " + ", ".join(f"{k} {v:.2f}" for k, v in step_times.items()),
        f"Memory-bandwidth floor of a target step: {roofline['target_weight_bytes'] / 1e6:.1f} MB of weights / "
        f"{roofline['bandwidth_gbps']:.1f} GB/s measured copy bandwidth = {roofline['floor_ms']:.2f} ms; "
        + ", ".join(f"{name} {ratio:.2f}x the floor" for name, ratio in roofline["over_floor"].items()),
        f"{faster_by} against eager, step times (ms, median): "
        + ", ".join(f"{k} {step_times[k]:.2f} vs {ms:.2f} ({ms / step_times[k]:.2f}x faster)" for k, ms in eager.items())
        if eager is not None else "against eager: not measured (no CUDA graphs or cpu_compile, or the hf engine)",
    ]
    return step_times, roofline, eager, notes
