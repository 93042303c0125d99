"""Through a real server: concurrent streams progress together, and cancellation frees a sequence promptly."""
from __future__ import annotations

import queue
import threading
import time

import pytest
import tritonclient.grpc as grpcclient
from client.generate import generate_grpc, grpc_inputs
from triton_server import REPO_ROOT, configured_parameter

pytestmark = pytest.mark.server

NUM_STREAMS = 8
MAX_TOKENS = 48
PROMPTS = [
    "Once upon a time", "def add(a, b):\n    return", "The quick brown fox", "import os\nimport sys\n",
    "Hello, world!", "1, 2, 3, 4,", "class Node:\n    def __init__(self", "Grüße aus München",
]  # fmt: skip
ACTIVE = "spec_decode_num_active_sequences"
STATEFUL_MODELS = ("speculative_decoding", "target_verifier", "draft_proposer")


def active_sequences(server) -> dict[str, float]:
    """Each stateful model's gauge; draft_proposer has none where another process loads the draft."""
    samples = server.metrics()
    return {model: samples[(ACTIVE, (("model", model),))] for model in STATEFUL_MODELS
            if model != "draft_proposer" or (ACTIVE, (("model", model),)) in samples}  # fmt: skip


def output_tokens(server) -> float:
    return server.metrics().get(("spec_decode_num_output_tokens", (("model", "speculative_decoding"),)), 0.0)


def wait_until_idle(server, timeout_s: float = 5.0) -> float:
    """Seconds until every model holds no sequence; fails after ``timeout_s``."""
    start = time.perf_counter()
    while time.perf_counter() - start < timeout_s:
        if not any(active_sequences(server).values()):
            return time.perf_counter() - start
        time.sleep(0.02)
    pytest.fail(f"sequences still held after {timeout_s} s: {active_sequences(server)}")


def steps_and_verify_calls(server) -> tuple[float, float]:
    """The orchestrator's target passes (one per sequence step) and the verifier calls that carried them."""
    samples, labels = server.metrics(), (("model", "speculative_decoding"),)
    steps = samples.get(("spec_decode_num_steps", labels), 0.0)
    return steps, samples.get(("spec_decode_stage_calls", labels + (("stage", "verify"),)), 0.0)


@pytest.mark.parametrize(
    "server_name", ["server", "ngram_server", "table_server"], ids=["shipped_suffix", "ngram", "draft_model_table"]
)
def test_concurrent_streams_match_one_by_one_and_share_forwards(server_name, request):
    server = request.getfixturevalue(server_name)
    params = {"stream": True, "max_tokens": MAX_TOKENS, "exclude_input_in_output": True}
    generate_grpc(server.grpc_url, "ensemble", PROMPTS[0], params)  # warm up every model
    start = time.perf_counter()
    alone = [generate_grpc(server.grpc_url, "ensemble", prompt, params).text for prompt in PROMPTS]
    one_by_one_s = time.perf_counter() - start

    together: list[str | None] = [None] * NUM_STREAMS

    def run(i: int) -> None:
        together[i] = generate_grpc(server.grpc_url, "ensemble", PROMPTS[i], params).text

    threads = [threading.Thread(target=run, args=(i,)) for i in range(NUM_STREAMS)]
    steps_before, calls_before = steps_and_verify_calls(server)
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    concurrent_s = time.perf_counter() - start
    assert together == alone
    # They ran at once: verifier calls carried the steps of several sequences (speed is the benchmark's job).
    steps, calls = steps_and_verify_calls(server)
    assert steps - steps_before > calls - calls_before > 0
    print(f"8 one by one: {one_by_one_s:.2f} s, 8 concurrent: {concurrent_s:.2f} s")
    wait_until_idle(server)


def test_more_streams_than_slots_wait_their_turn_and_decode_exactly(server, reference):
    """Twice ``max_num_seqs`` streams at once: the later ones queue for a slot, none fails, every text is greedy."""
    slots = int(configured_parameter(REPO_ROOT / "model_repository" / "target_verifier", "max_num_seqs"))
    prompts = [f"{PROMPTS[i % len(PROMPTS)]} {i}" for i in range(2 * slots)]
    max_tokens = 16
    params = {"stream": True, "max_tokens": max_tokens, "exclude_input_in_output": True}
    texts: list[str | None] = [None] * len(prompts)
    errors: list[BaseException] = []
    peak = {model: 0.0 for model in STATEFUL_MODELS}

    def run(i: int) -> None:
        try:
            texts[i] = generate_grpc(server.grpc_url, "ensemble", prompts[i], params).text
        except BaseException as err:  # noqa: BLE001 - reported below, with the stream it came from
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    while any(thread.is_alive() for thread in threads):
        for model, held in active_sequences(server).items():
            peak[model] = max(peak[model], held)
        time.sleep(0.02)
    assert not errors, errors
    failures = [f for f in (reference.greedy_mismatch(p, t, max_tokens) for p, t in zip(prompts, texts)) if f]
    assert not failures, "\n".join(failures)
    assert peak["speculative_decoding"] == slots and max(peak.values()) <= slots
    wait_until_idle(server)


def test_cancellation_mid_stream_stops_the_sequence(server, reference):
    """Sent to speculative_decoding: Triton 2.51 does not forward an ensemble's cancellation to its steps."""
    max_tokens = reference.max_model_len - 16
    before = output_tokens(server)
    client = grpcclient.InferenceServerClient(server.grpc_url)
    responses: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: responses.put((result, error)))
    inputs = grpc_inputs("Once upon a time", {"stream": True, "max_tokens": max_tokens, "num_speculative_tokens": 1})
    client.async_stream_infer("speculative_decoding", inputs)
    received = 0
    for _ in range(2):
        result, error = responses.get(timeout=30)
        assert error is None, error
        received = int(result.as_numpy("num_output_tokens")[0])
    client.stop_stream(cancel_requests=True)
    client.close()
    idle_after_s = wait_until_idle(server)
    generated = output_tokens(server) - before
    print(f"received {received} tokens, generated {generated:.0f} of {max_tokens}; idle {idle_after_s:.3f} s later")
    assert received <= generated < max_tokens / 4
    time.sleep(0.5)
    assert output_tokens(server) - before == generated  # nothing runs on after the sequence was freed
