"""What the orchestrator does when a composing model's stub dies: answer at once, then reload or stop.

A :class:`Supervisor` thread checks the stubs (:class:`~specdec_triton.health.StubWatch`)
every ``interval_s``, and at once when a request's error names a dead stub
(:meth:`Supervisor.poke`). On a death it

1. fails every request in flight with UNAVAILABLE and refuses new ones
   (:meth:`~specdec_triton.orchestrator.Orchestrator.stage_failed`, run on the
   orchestrator's event loop), so no client waits for a model that will not answer;
2. reloads the dead models (``pb_utils.unload_model``, then ``load_model``, so that
   Triton's strict readiness answers not ready while they load; Triton allows it under
   ``--model-control-mode=explicit``, which ``scripts/serve.sh`` sets) and, once they
   answer, serves again with a fresh scheduler;
3. where it cannot reload (another model control mode, or the load fails), or with
   ``on_stub_failure: stop``, stops the server (SIGTERM to ``tritonserver``): Triton
   then reports not ready at once and exits, so a load balancer stops routing to it
   and an orchestrator such as Kubernetes restarts it. A server that stays up with a
   dead stub would answer ``/v2/health/ready`` with 200 and fail every request.

The same thread asks, at each check, whether the server is stopping
(:class:`~specdec_triton.server_stop.ServerStopWatch`). Once it is, every request in flight
ends at once with UNAVAILABLE ("the server is shutting down"), whichever way it came
in, and nothing more is recovered: Triton unloads its models only once no request is
in flight through an ``ensemble``, so the drain cannot wait for ``finalize``.

Nothing here imports Triton: the reload and stop actions are given to it.
"""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from dataclasses import dataclass

from specdec_triton.health import StubWatch, dead_stub_in
from specdec_triton.server_stop import SERVER_NOT_READY

ON_STUB_FAILURE = ("reload", "stop")
SHUTTING_DOWN = "the server is shutting down"  # why requests end once the server stops


@dataclass(frozen=True)
class RecoveryActions:
    reload: Callable[[str], None]  # loads the named model again; raises if it cannot
    stop_server: Callable[[], None]  # asks the server to shut down
    log: Callable[[str], None]
    log_error: Callable[[str], None]
    server_stopping: Callable[[], bool] = lambda: False  # the server was told to stop (SIGTERM, SIGINT)


class Supervisor:
    def __init__(self, orchestrator, watch: StubWatch, actions: RecoveryActions, on_failure: str = "reload",
                 interval_s: float = 0.5):  # fmt: skip
        if on_failure not in ON_STUB_FAILURE:
            raise ValueError(f"on_stub_failure must be one of {ON_STUB_FAILURE}, got {on_failure!r}")
        self.orchestrator = orchestrator
        self.watch = watch
        self.actions = actions
        self.on_failure = on_failure
        self.interval_s = interval_s
        self.loop: asyncio.AbstractEventLoop | None = None  # the orchestrator's, once it serves
        self.stopping = False  # the server was asked to stop: nothing more to recover
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="specdec-supervisor", daemon=True)

    def start(self) -> Supervisor:
        self._thread.start()
        return self

    def close(self, timeout_s: float = 2.0) -> None:
        self._closed.set()
        self._wake.set()
        self._thread.join(timeout_s)

    def poke(self, error_message: str) -> None:
        """A request failed with ``error_message``: check now if it names a dead stub or a stopping server."""
        if dead_stub_in(error_message) is not None or SERVER_NOT_READY in error_message:
            self._wake.set()

    def _run(self) -> None:
        while not self._closed.is_set():
            self._wake.wait(self.interval_s)
            self._wake.clear()
            if self._closed.is_set() or self.stopping:
                continue
            if self.actions.server_stopping():
                self.drain()
                continue
            dead = self.watch.dead()
            if dead:
                self.handle(dead)

    def handle(self, dead: list[str]) -> None:
        """Fail the requests, then reload the dead models or stop the server."""
        self.actions.log_error(f"composing model(s) {', '.join(dead)} stopped: failing every request in flight")
        self.call_on_loop(self.orchestrator.stage_failed, dead)
        if self.on_failure == "reload":
            try:
                for model in dead:
                    self.actions.reload(model)
            except Exception as err:
                self.actions.log_error(f"reloading {', '.join(dead)} failed ({err}); stopping the server")
            else:
                still_dead = self.watch.dead()
                if not still_dead:
                    self.call_on_loop(self.orchestrator.recovered)
                    self.actions.log(f"reloaded {', '.join(dead)}; serving again")
                    return
                self.actions.log_error(f"{', '.join(still_dead)} still not running after a reload; stopping the server")
        self.stopping = True
        self.actions.stop_server()

    def drain(self) -> None:
        """The server is stopping: end every request now, refuse new ones, recover nothing more."""
        self.stopping = True
        self.actions.log("the server is shutting down: ending every request in flight")
        self.call_on_loop(self.orchestrator.stop_serving, SHUTTING_DOWN)

    def call_on_loop(self, function: Callable, *args) -> None:
        """Run ``function`` on the orchestrator's loop and wait for it; directly when no loop runs (none has
        served yet, or it has stopped): a call sent to a loop that does not run waits out the timeout."""
        loop = self.loop
        if loop is None or loop.is_closed() or not loop.is_running():
            function(*args)
            return

        async def call():
            function(*args)

        try:
            asyncio.run_coroutine_threadsafe(call(), loop).result(timeout=10)
        except Exception as err:  # a loop that no longer runs: nothing is in flight on it
            self.actions.log_error(f"could not reach the orchestrator's event loop: {err!r}")
