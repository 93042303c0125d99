"""What draft_proposer and target_verifier do alike around their model: callers, releases, expiry, gauge.

Both hold one state per live sequence and answer the same four kinds of request
(describe, release, renew, work), so the checks live here once: every request but
describe must carry the server's secret (:mod:`specdec_triton.internal`); the sequences
a batch names or renews are marked used, then those idle past ``idle_timeout_s`` are
reclaimed, then releases run, then the work (:mod:`specdec_triton.leases`: the time of
this model's own calls is not idleness); the active-sequences gauge follows every batch. Calls
come as Triton requests to ``execute`` and, from the orchestrator, on a Unix socket
(:mod:`specdec_triton.socket_calls`) answered on other threads: one lock keeps them
apart, so the model's state still has one writer at a time.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from specdec.types import ModelDescription
from specdec_triton import wire
from specdec_triton.health import register_stub
from specdec_triton.internal import boot_secret
from specdec_triton.leases import SequenceLeases
from specdec_triton.metrics import ActiveSequences, ExpiredSequences, SocketCallTime
from specdec_triton.plumbing import ModelLogger
from specdec_triton.socket_calls import SocketCallServer

Inputs = Mapping[str, np.ndarray]


class SequenceHost:
    def __init__(self, name: str, holder, description: ModelDescription, idle_timeout_s: float, logger: ModelLogger,
                 model_config: str | None = None, keeps_responses: bool = False,
                 describe_extra: dict | None = None):  # fmt: skip
        self.name, self.holder, self.description, self.logger = name, holder, description, logger
        self.keeps_responses = keeps_responses  # the proposer: a release may carry completed responses
        self.describe_outputs = {**wire.description_outputs(description), **wire.socket_outputs(None),
                                 **(describe_extra or {})}  # fmt: skip
        self.secret = boot_secret()  # only the orchestrator may call
        self.active: ActiveSequences | None = ActiveSequences(name)
        self.expired: ExpiredSequences | None = ExpiredSequences(name)
        self.leases = SequenceLeases(idle_timeout_s, holder.release)
        register_stub(name, model_config)  # the orchestrator watches this process, and reloads it with this
        self.lock = threading.Lock()  # execute and the socket's threads take turns
        self.socket: SocketCallServer | None = None
        self.socket_time: SocketCallTime | None = None

    def serve_socket(self, handle_batch: Callable[[list[Inputs]], list[dict]]) -> None:
        """Answer calls on a Unix socket as well, with ``handle_batch`` (execute's), and describe its path.

        A socket that cannot be made (a temporary directory whose path is too long for
        one) is logged, and the orchestrator then calls by BLS as before.
        """
        self.socket_time = SocketCallTime(self.name)

        def answer(inputs: dict, output_names: Sequence[str]) -> dict:
            started = time.perf_counter()
            outputs = handle_batch([inputs])[0]
            self.show_active()
            timer = self.socket_time  # None once closed
            if timer is not None:
                timer.add(time.perf_counter() - started, flush=wire.is_release(inputs))
            return outputs

        try:
            self.socket = SocketCallServer(self.name, answer, self.logger)
        except (ValueError, OSError) as err:
            self.logger.warning(f"no socket for step calls, BLS only: {err}")
            return
        self.describe_outputs = {**self.describe_outputs, **wire.socket_outputs(self.socket.address)}

    def close(self) -> None:
        """Stop the socket, and drop the metric families while the stub still stands: Triton 2.51's Python
        backend destroys a family still referenced at exit inside the stub's destructor, whose write to
        shared memory then segfaults (triton-inference-server/python_backend#429, fixed after 2.51)."""
        if self.socket is not None:
            self.socket.close()
        with self.lock:  # no call in flight: the socket's threads may still end one
            self.active = self.expired = self.socket_time = None

    def handle(self, batch: list[Inputs], requests_of: Callable[[Inputs], list], run: Callable[[list], list],
               outputs_of: Callable[[list], dict]) -> list[dict]:  # fmt: skip
        """Checks, expiry and releases, then every sequence of every work request in one ``run`` call."""
        with self.lock:
            return self._handle(batch, requests_of, run, outputs_of)

    def _handle(self, batch, requests_of, run, outputs_of) -> list[dict]:
        for inputs in batch:
            if not wire.is_describe(inputs):
                wire.check_caller(inputs, self.secret, self.name)
        requests = [[] if _holds_no_work(x) else requests_of(x) for x in batch]
        flat = [r for group in requests for r in group]
        self.leases.touch(r.seq_id for r in flat)  # before the expiry: a batch never reclaims what it uses
        for inputs in batch:
            if wire.is_renew(inputs):
                self.leases.renew(wire.seq_ids_of(inputs))
        reclaimed = self.leases.expire()
        if reclaimed:
            if self.expired is not None:
                self.expired.add(reclaimed)
            self.logger.warning(f"reclaimed {reclaimed} sequence(s) no request used for "
                                f"{self.leases.idle_timeout_s:g} s (sequence_idle_timeout_s)")  # fmt: skip
        for inputs in batch:
            if wire.is_release(inputs):
                seq_ids = wire.seq_ids_of(inputs)
                # the proposer's releases carry the responses of completed requests (suffix decoding keeps them)
                responses = wire.responses_of(inputs) if self.keeps_responses else [[]] * len(seq_ids)
                for seq_id, response in zip(seq_ids, responses):
                    if response:
                        self.holder.release(seq_id, response)
                    else:
                        self.holder.release(seq_id)
                self.leases.forget(seq_ids)
        started = self.leases.clock()
        try:
            results = iter(run(flat))
        finally:  # a slow call (a cold compile) is nobody's idleness; a failed one may have taken a slot
            self.leases.call_took(self.leases.clock() - started)
            self.leases.touch(r.seq_id for r in flat)
        return [
            self.describe_outputs if wire.is_describe(inputs)
            else outputs_of([next(results) for _ in group])
            for inputs, group in zip(batch, requests)
        ]  # fmt: skip

    def show_active(self) -> None:
        gauge = self.active  # None once closed
        if gauge is not None:
            gauge.set(self.holder.num_active_sequences)


def _holds_no_work(inputs: Inputs) -> bool:
    return wire.is_describe(inputs) or wire.is_release(inputs) or wire.is_renew(inputs)
