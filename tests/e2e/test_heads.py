"""Through a real server: draft heads that read the target's hidden states keep the output exact.

Each server serves a copy of the repository whose draft_proposer loads a shipped head
(``tiny-eagle3``, ``tiny-mlp-speculator``), so the target's hidden states travel
target_verifier -> orchestrator -> draft_proposer on every step. Heads with random weights
and a reduced draft vocabulary are held to the target's output in the unit tests
(``tests/test_eagle3.py``); Medusa is served with a tree (``test_trees.py``). The shipped EAGLE-3 head is served in both
placements: its own model, and with ``run_with_target`` on draft_proposer (the head runs
in target_verifier's process, a step is one call there, and the hidden states never
leave the target's process). A trained head is only accepted if they arrive whole.
"""
from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
from client.generate import generate_grpc, generate_http
from test_concurrency import PROMPTS as STREAM_PROMPTS, wait_until_idle
from test_faults import (
    ERROR_WITHIN_S, RECOVERY_TIMEOUT_S, STOP_WITHIN_S, alive, serves_again, streams_interrupted, streams_killed_midway,
)  # fmt: skip
from triton_server import models_dir, repository_copy, server_on_free_ports

pytestmark = pytest.mark.server

MAX_TOKENS = 24
PROMPTS = ["Once upon a time", "def fibonacci(n):\n    if n < 2:\n        return n\n    return", "1, 2, 3, 4, 5,"]
N_PREDICT = 3  # the shipped MLP speculator's


SHIPPED_HEADS = {"eagle3": "tiny-eagle3", "mlp_speculator": "tiny-mlp-speculator"}


def _serve(tmp_path_factory, method: str, parameters: dict[str, str] | None = None):
    """A server whose draft_proposer loads the shipped head of ``method``."""
    models = models_dir()
    head = models / SHIPPED_HEADS[method]
    if not (models / "tiny-target").is_dir() or not head.is_dir():
        pytest.skip(f"no tiny-target or {head.name} under {models}")
    workdir = tmp_path_factory.mktemp(f"server_{method}")
    # every step drafts the table's k, so that a seed gives the same text on each server: a head's drafts shape the draws
    fixed_k = {"speculation_follows_acceptance": "false"}
    repository = repository_copy(workdir, models, method, parameters={"draft_model": str(head), **fixed_k,
                                                                      **(parameters or {})})  # fmt: skip
    server = server_on_free_ports(workdir, repository)
    server.start()
    return server


@pytest.fixture(scope="module")
def shipped_eagle3_server(tmp_path_factory):
    """The shipped head in its own model, draft_proposer."""
    server = _serve(tmp_path_factory, "eagle3")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def shipped_eagle3_beside_server(tmp_path_factory):
    """The shipped head in target_verifier's process (draft_proposer's run_with_target): one call a step."""
    server = _serve(tmp_path_factory, "eagle3", {"run_with_target": "true"})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def shipped_mlp_server(tmp_path_factory):
    """k = 3, its n_predict (the shipped orchestrator drafts up to 8)."""
    server = _serve(tmp_path_factory, "mlp_speculator",
                    {"num_speculative_tokens": "3", "num_speculative_tokens_per_batch_size": "1:3,5:0"})
    yield server
    server.stop()


def _accepted_and_exact(server, reference, stream: bool) -> int:
    """Greedy text equal to the target's for every prompt; the drafts accepted in all."""
    accepted = 0
    for prompt in PROMPTS:
        params = {"max_tokens": MAX_TOKENS, "exclude_input_in_output": True, "stream": stream}
        generate = generate_grpc if stream else generate_http
        result = generate(server.grpc_url if stream else server.http_url, "ensemble", prompt, params)
        assert reference.greedy_mismatch(prompt, result.text, MAX_TOKENS) is None
        accepted += result.total_accepted_draft_tokens
    return accepted


@pytest.mark.parametrize("stream", [True, False], ids=["grpc-stream", "http"])
def test_the_shipped_eagle3_head_is_accepted_and_exact(shipped_eagle3_server, reference, stream):
    # a trained head: its drafts are accepted through the whole served path
    assert _accepted_and_exact(shipped_eagle3_server, reference, stream=stream) > 0


def test_sampled_requests_with_the_head_in_its_own_model_hold_q_in_the_sampler(shipped_eagle3_server):
    """The head's q goes from draft_proposer's process to rejection_sampler, which judges the step."""
    params = {"max_tokens": MAX_TOKENS, "temperature": 0.8, "top_p": 0.95, "seed": 7, "stream": False,
              "exclude_input_in_output": True}
    first = generate_http(shipped_eagle3_server.http_url, "ensemble", PROMPTS[1], params)
    again = generate_http(shipped_eagle3_server.http_url, "ensemble", PROMPTS[1], {**params, "stream": True})
    assert first.text == again.text and first.total_accepted_draft_tokens > 0


def test_the_shipped_eagle3_head_beside_the_target_is_accepted_and_exact(shipped_eagle3_beside_server, reference):
    assert _accepted_and_exact(shipped_eagle3_beside_server, reference, stream=True) > 0
    log = shipped_eagle3_beside_server.log_path.read_text()
    assert "run_with_target: draft_proposer's eagle3" in log and "runs here" in log


def test_sampled_text_is_the_same_in_both_placements_of_the_head(shipped_eagle3_beside_server, shipped_eagle3_server):
    """Seed for seed: q held in the sampler from target_verifier's process or from draft_proposer's, p judged
    there: rejection_sampler owns the rule and its random numbers, wherever the head runs."""
    params = {"max_tokens": MAX_TOKENS, "temperature": 0.8, "top_p": 0.95, "seed": 11, "stream": False,
              "exclude_input_in_output": True}  # fmt: skip
    for prompt in PROMPTS:
        beside = generate_http(shipped_eagle3_beside_server.http_url, "ensemble", prompt, params)
        own = generate_http(shipped_eagle3_server.http_url, "ensemble", prompt, params)
        assert beside.text == own.text and beside.total_accepted_draft_tokens == own.total_accepted_draft_tokens


def test_the_shipped_mlp_speculator_is_accepted_and_exact(shipped_mlp_server, reference):
    assert _accepted_and_exact(shipped_mlp_server, reference, stream=True) > 0  # trained stages accepted


def test_mlp_speculator_serves_k_up_to_n_predict_and_refuses_more_by_name(shipped_mlp_server, reference):
    server, params = shipped_mlp_server, {"max_tokens": MAX_TOKENS, "exclude_input_in_output": True, "stream": False}
    with pytest.raises(Exception, match=rf"'num_speculative_tokens' must be in \[0, {N_PREDICT}\]"):
        generate_http(server.http_url, "ensemble", PROMPTS[1], {**params, "num_speculative_tokens": N_PREDICT + 1})
    again = generate_http(server.http_url, "ensemble", PROMPTS[2], {**params, "num_speculative_tokens": 1})
    assert reference.greedy_mismatch(PROMPTS[2], again.text, MAX_TOKENS) is None


@pytest.mark.slow
def test_a_killed_target_with_the_head_beside_it_comes_back_and_a_killed_tritonserver_leaves_no_process(
        shipped_eagle3_beside_server, reference):  # fmt: skip
    """The last test on this server: its target (the head beside it) killed under load and back, then
    tritonserver killed (``test_faults.py`` has the composing models' faults).

    SIGKILL of tritonserver under load: every stub sees its server gone and ends, with what it started.
    """
    server = shipped_eagle3_beside_server
    ends = streams_killed_midway(server, "target_verifier")
    for seconds, error in ends:
        assert seconds is not None and seconds < ERROR_WITHIN_S and "target_verifier stopped" in error, ends
    seconds, _ = serves_again(server, reference, RECOVERY_TIMEOUT_S)
    print(f"head beside the target: serving again {seconds:.1f} s after the kill")
    again = generate_grpc(server.grpc_url, "ensemble", STREAM_PROMPTS[1],
                          {"max_tokens": 24, "exclude_input_in_output": True})  # fmt: skip
    assert again.total_accepted_draft_tokens > 0  # the head came back with the target, and drafts
    wait_until_idle(server, timeout_s=10)
    lines = subprocess.run(["ps", "-ww", "-o", "pid=,args=", "--ppid", str(server.process.pid)],
                           capture_output=True, text=True).stdout.splitlines()  # fmt: skip
    stubs = {int(line.split()[0]): line for line in lines if "/1/model.py" in line}
    assert len(stubs) == 6, lines
    ends = streams_interrupted(server, lambda: os.kill(server.process.pid, signal.SIGKILL))  # with streams in flight
    assert all(error != "finished" for _, error in ends)
    server.process.wait(10)
    deadline = time.monotonic() + STOP_WITHIN_S
    while (left := [stubs[pid] for pid in stubs if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"model processes alive {STOP_WITHIN_S:g} s after the server was killed: {left}"
