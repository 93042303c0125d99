"""A composing model that dies: its detection (health), the orchestrator's answer, the supervisor's reload or stop,
and the reclaiming of sequences nobody released (leases)."""
from __future__ import annotations

import asyncio
import os
import time

import pytest
from local_orchestrator import (  # noqa: F401 (codec, models: fixtures)
    PROMPTS, FakeFamily, codec, make_orchestrator, models, request, run, text_of,
)

from specdec_triton.health import StubWatch, dead_stub_in, is_alive, loaded_config, pid_path, register_stub
from specdec_triton.leases import SequenceLeases
from specdec_triton.plumbing import ServingError
from specdec_triton.recovery import RecoveryActions, Supervisor

GAUGE = ("spec_decode_num_active_sequences", (("model", "sd"),))


def hang_verify_after(stages, calls: int) -> asyncio.Event:
    """From the ``calls``-th verify call on, verify never answers (a stage whose process died)."""
    never = asyncio.Event()
    verify, count = stages.verify, [0]

    async def hanging(requests):
        count[0] += 1
        if count[0] >= calls:
            await never.wait()
        return await verify(requests)

    stages.verify = hanging
    return never


def test_a_stopped_stage_fails_every_request_at_once_and_the_server_serves_again_after_recovery(codec, models):
    orchestrator, stages = make_orchestrator(codec, models)
    expected = text_of(run(orchestrator, request(PROMPTS[0])))

    async def scenario():
        hang_verify_after(stages, calls=3)
        sent = []
        tasks = [asyncio.ensure_future(orchestrator.generate(request(p, stream=True, max_tokens=40),
                                                             lambda out, final: sent.append(final), lambda: False))
                 for p in PROMPTS]  # fmt: skip
        while orchestrator.scheduler is None or orchestrator.scheduler.num_running < len(PROMPTS):
            await asyncio.sleep(0)
        await asyncio.sleep(0.01)  # the step now waits on the hung verify
        started = time.monotonic()
        orchestrator.stage_failed(["target_verifier"])
        outcomes = await asyncio.gather(*tasks, return_exceptions=True)
        assert time.monotonic() - started < 1.0
        assert all(isinstance(o, ServingError) and "target_verifier stopped" in str(o) for o in outcomes), outcomes
        assert True not in sent  # no final text: the error is the final answer
        with pytest.raises(ServingError, match="recovering"):
            await orchestrator.generate(request(PROMPTS[0]), lambda *a: None, lambda: False)
        await asyncio.sleep(0.01)  # the background release
        return stages.released

    released = asyncio.run(scenario())
    assert len(set(released)) == 1 + len(PROMPTS)  # the first request's sequence, then every failed one
    assert FakeFamily.metrics[GAUGE].value == 0 and orchestrator.num_active_requests == 0
    orchestrator.recovered()
    stages.verify = type(stages).verify.__get__(stages)  # the reloaded stage answers again
    assert text_of(run(orchestrator, request(PROMPTS[0]))) == expected


def test_the_scheduler_answers_sequences_whose_release_is_in_flight(codec, models):
    """A sequence that finished and waits for its release gets the fault too, rather than waiting forever."""
    orchestrator, stages = make_orchestrator(codec, models)
    never = asyncio.Event()

    async def hanging_release(seq_ids):
        await never.wait()

    stages.release = hanging_release

    async def scenario():
        task = asyncio.ensure_future(orchestrator.generate(request(PROMPTS[1], max_tokens=2), lambda *a: None,
                                                           lambda: False))  # fmt: skip
        while orchestrator.scheduler is None or not orchestrator.scheduler._ending:
            await asyncio.sleep(0)
        orchestrator.stage_failed(["draft_proposer"])
        return await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 1.0)

    (outcome,) = asyncio.run(scenario())
    assert isinstance(outcome, ServingError) and "draft_proposer stopped" in str(outcome)


def test_a_process_is_dead_once_it_exits_even_before_it_is_reaped():
    assert is_alive(os.getpid())
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 5
        while is_alive(pid) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not is_alive(pid)  # a zombie: exited, not yet waited for
    finally:
        os.waitpid(pid, 0)
    assert not is_alive(pid)


def test_the_watch_reads_each_models_registered_process(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_SECRET_DIR", str(tmp_path))
    register_stub("tokenizer", '{"name": "tokenizer"}', server_pid=7)
    assert pid_path("tokenizer", 7).read_text() == str(os.getpid())
    assert loaded_config("tokenizer", 7) == '{"name": "tokenizer"}' and loaded_config("draft_proposer", 7) == ""
    pid_path("target_verifier", 7).write_text("999999999")  # no such process
    watch = StubWatch(["tokenizer", "target_verifier", "draft_proposer"], server_pid=7)
    assert watch.dead() == ["target_verifier"]  # draft_proposer never registered: not watched


def test_the_error_that_names_a_dead_stub():
    assert dead_stub_in("Stub process 'target_verifier_0_0' is not healthy.") == "target_verifier"
    assert dead_stub_in("Failed to process the request(s) for model 'draft_proposer_0_1', message: Stub process "
                        "'draft_proposer_0_1' is not healthy.") == "draft_proposer"  # fmt: skip
    assert dead_stub_in("KV cache is full") is None


class FakeOrchestrator:
    def __init__(self):
        self.events = []

    def stage_failed(self, models):
        self.events.append(("failed", tuple(models)))

    def recovered(self):
        self.events.append(("recovered",))

    def stop_serving(self, why):
        self.events.append(("stopped", why))


class FixedWatch:
    def __init__(self, *answers):
        self.answers = list(answers)

    def dead(self):
        return self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]


def supervise(on_failure, reload, *dead_answers):
    orchestrator, calls = FakeOrchestrator(), []
    actions = RecoveryActions(reload=lambda model: (calls.append(("reload", model)), reload(model)),
                              stop_server=lambda: calls.append(("stop",)), log=lambda m: None,
                              log_error=lambda m: None)  # fmt: skip
    supervisor = Supervisor(orchestrator, FixedWatch(*dead_answers), actions, on_failure)
    supervisor.handle(["target_verifier"])
    return orchestrator.events, calls, supervisor


def test_a_reloaded_model_serves_again():
    events, calls, supervisor = supervise("reload", lambda model: None, [])
    assert events == [("failed", ("target_verifier",)), ("recovered",)]
    assert calls == [("reload", "target_verifier")] and not supervisor.stopping


def test_a_model_that_cannot_be_reloaded_stops_the_server():
    def refuse(model):
        raise RuntimeError("load/unload is not allowed in model control mode NONE")

    events, calls, supervisor = supervise("reload", refuse, [])
    assert events == [("failed", ("target_verifier",))]
    assert calls == [("reload", "target_verifier"), ("stop",)] and supervisor.stopping


def test_a_reload_that_leaves_the_process_dead_stops_the_server():
    events, calls, _ = supervise("reload", lambda model: None, ["target_verifier"])
    assert calls[-1] == ("stop",) and ("recovered",) not in events


def test_on_stub_failure_stop_stops_without_reloading():
    events, calls, _ = supervise("stop", lambda model: None, [])
    assert calls == [("stop",)]


def test_the_supervisor_thread_reacts_to_a_death(tmp_path):
    orchestrator, stopped = FakeOrchestrator(), []
    actions = RecoveryActions(reload=lambda model: None, stop_server=lambda: stopped.append(True),
                              log=lambda m: None, log_error=lambda m: None)  # fmt: skip
    watch = FixedWatch([], ["rejection_sampler"], [])
    supervisor = Supervisor(orchestrator, watch, actions, "reload", interval_s=0.01).start()
    try:
        deadline = time.monotonic() + 5
        while ("recovered",) not in orchestrator.events and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        supervisor.close()
    assert orchestrator.events == [("failed", ("rejection_sampler",)), ("recovered",)] and not stopped


def test_a_stopping_server_ends_every_request_and_recovers_nothing_more():
    orchestrator, stopping = FakeOrchestrator(), [False]
    actions = RecoveryActions(reload=lambda model: None, stop_server=lambda: None, log=lambda m: None,
                              log_error=lambda m: None, server_stopping=lambda: stopping[0])  # fmt: skip
    watch = FixedWatch([])
    supervisor = Supervisor(orchestrator, watch, actions, "reload", interval_s=0.01).start()
    try:
        time.sleep(0.05)
        stopping[0] = True
        deadline = time.monotonic() + 5
        while not orchestrator.events and time.monotonic() < deadline:
            time.sleep(0.01)
        watch.answers = [["target_verifier"]]  # a stub that exits with the server is not reloaded
        time.sleep(0.05)
    finally:
        supervisor.close()
    assert orchestrator.events == [("stopped", "the server is shutting down")] and supervisor.stopping


def test_a_call_for_a_loop_that_no_longer_runs_is_made_at_once():
    """At ``finalize`` the stub's event loop may have stopped: a call sent to it would wait out its timeout."""
    _, _, supervisor = supervise("reload", lambda model: None, [])
    calls = []
    supervisor.loop = asyncio.new_event_loop()  # made, never run: what a stopped loop looks like
    try:
        started = time.monotonic()
        supervisor.call_on_loop(calls.append, "now")
        assert calls == ["now"] and time.monotonic() - started < 1
    finally:
        supervisor.loop.close()


def test_unknown_on_stub_failure_is_refused():
    with pytest.raises(ValueError, match="on_stub_failure must be one of"):
        Supervisor(FakeOrchestrator(), FixedWatch([]), None, "restart")


def test_sequences_idle_past_the_timeout_are_released():
    now, released = [0.0], []
    leases = SequenceLeases(10.0, released.append, clock=lambda: now[0])
    leases.touch(["a", "b"])
    now[0] = 8.0
    leases.touch(["b"])
    assert leases.expire() == 0
    now[0] = 11.0
    assert leases.expire() == 1 and released == ["a"] and len(leases) == 1
    leases.forget(["b"])
    now[0] = 100.0
    assert leases.expire() == 0 and released == ["a"]


def test_an_idle_timeout_of_zero_never_expires():
    now, released = [0.0], []
    leases = SequenceLeases(0.0, released.append, clock=lambda: now[0])
    leases.touch(["a"])
    now[0] = 1e9
    assert leases.expire() == 0 and released == []
