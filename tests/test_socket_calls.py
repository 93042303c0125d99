"""specdec_triton.socket_calls: frames, the model's server and the orchestrator's client, without Triton."""
import asyncio
import json
import os
import shutil
import socket
import stat
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from specdec_triton import wire
from specdec_triton.model_stages import DraftInItsOwnModel, DraftWithTheTarget
from specdec_triton.health import dead_stub_in
from specdec_triton.metrics import SocketCallTime
from specdec_triton.plumbing import ModelLogger, RequestError, ServingError
from specdec_triton.socket_calls import SocketCallClient, SocketCallServer, body_length, decode_arrays, encode


def _round_trip(arrays):
    frame = b"".join(bytes(part) for part in encode({"outputs": ["x"]}, arrays))
    header_length = int.from_bytes(frame[:4], "little")
    header = json.loads(frame[4:4 + header_length])
    body = frame[4 + header_length:]
    assert len(body) == body_length(header)
    return header, decode_arrays(header, bytearray(body))


def test_a_frame_carries_every_wire_dtype_and_shape_back_unchanged():
    arrays = {
        "token_ids": np.arange(7, dtype=np.int64),
        "num_logits": np.array([1, 5], dtype=np.int32),
        "temperature": np.array([0.0, 0.7], dtype=np.float32),
        "hidden_states": np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32),
        "release": np.array([True]),
        "sample_seed": np.array([2**63 + 5], dtype=np.uint64),
        "seq_id": np.array([b"a", b"", "\u00e9t\u00e9".encode()], dtype=np.object_),
        "empty": np.zeros((0, 0), dtype=np.float32),
    }
    header, back = _round_trip(arrays)
    assert header["outputs"] == ["x"]
    assert list(back) == list(arrays)
    for name, array in arrays.items():
        assert back[name].dtype == array.dtype and back[name].shape == array.shape, name
        assert np.array_equal(back[name], array), name
    back["token_ids"][0] = 99  # writable, as the arrays a BLS response gives are


def _serve(handler):
    return SocketCallServer("target_verifier", handler, ModelLogger("target_verifier"))


def _echo(inputs, output_names):
    return {"doubled": inputs["x"] * 2, "unasked": np.zeros(1)}


def test_a_call_gets_the_outputs_it_named_from_the_model_and_no_others():
    server = _serve(_echo)
    try:
        async def main():
            client = await SocketCallClient.connect("target_verifier", server.address)
            try:
                return await client.call({"x": np.array([1, 2], dtype=np.int64)}, ["doubled"])
            finally:
                client.close()

        out = asyncio.run(main())
        assert list(out) == ["doubled"] and out["doubled"].tolist() == [2, 4]
    finally:
        server.close()


@pytest.mark.parametrize("raised, expected, text", [
    (ValueError("bad position"), RequestError, "target_verifier: bad position"),
    (ServingError("no free slot"), ServingError, "target_verifier: no free slot"),
    (KeyError("oops"), RuntimeError, "target_verifier: KeyError: 'oops'"),
])  # fmt: skip
def test_the_models_error_is_raised_again_by_kind_and_named(raised, expected, text):
    def fail(inputs, output_names):
        raise raised

    server = _serve(fail)
    try:
        async def main():
            client = await SocketCallClient.connect("target_verifier", server.address)
            try:
                with pytest.raises(expected) as caught:
                    await client.call({"x": np.array([1])}, ["doubled"])
                assert str(caught.value) == text
                # the connection still serves the next call
                with pytest.raises(expected):
                    await client.call({"x": np.array([1])}, ["doubled"])
            finally:
                client.close()

        asyncio.run(main())
    finally:
        server.close()


def test_an_answer_without_a_requested_output_is_an_error_naming_it():
    server = _serve(_echo)
    try:
        async def main():
            client = await SocketCallClient.connect("target_verifier", server.address)
            try:
                with pytest.raises(RuntimeError, match=r"lacks the requested output\(s\) \['missing'\]"):
                    await client.call({"x": np.array([1])}, ["doubled", "missing"])
            finally:
                client.close()

        asyncio.run(main())
    finally:
        server.close()


def test_concurrent_calls_each_get_their_own_answer_even_when_one_caller_is_cancelled():
    def slow_echo(inputs, output_names):
        time.sleep(0.05 if int(inputs["x"][0]) == 0 else 0.001)
        return {"doubled": inputs["x"] * 2}

    server = _serve(slow_echo)
    try:
        async def main():
            client = await SocketCallClient.connect("target_verifier", server.address)
            try:
                first = asyncio.ensure_future(client.call({"x": np.array([0])}, ["doubled"]))
                await asyncio.sleep(0.01)
                first.cancel()  # its answer still comes, and is dropped
                answers = await asyncio.gather(*(client.call({"x": np.array([i])}, ["doubled"]) for i in range(1, 6)))
                return [int(a["doubled"][0]) for a in answers]
            finally:
                client.close()

        assert asyncio.run(main()) == [2, 4, 6, 8, 10]
    finally:
        server.close()


def test_a_model_that_goes_away_fails_the_waiting_call_and_every_later_one_naming_it(tmp_path):
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)  # a model whose process dies inside a call
    address = str(tmp_path / "calls.sock")
    listener.bind(address)
    listener.listen(1)

    def read_one_frame_and_die():
        connection, _ = listener.accept()
        connection.recv(1 << 16)
        connection.close()

    dying = threading.Thread(target=read_one_frame_and_die)
    dying.start()

    async def main():
        client = await SocketCallClient.connect("target_verifier", address)
        with pytest.raises(ServingError, match="target_verifier stopped: the connection to its process closed"):
            await client.call({"x": np.array([1])}, ["doubled"])
        assert client.broken
        assert dead_stub_in(client.broken) == "target_verifier"  # the supervisor checks the processes at once
        with pytest.raises(ServingError, match="target_verifier"):
            await client.call({"x": np.array([1])}, ["doubled"])
        client.close()

    try:
        asyncio.run(main())
    finally:
        dying.join()
        listener.close()


def test_the_socket_lives_in_a_directory_only_the_servers_user_can_open_and_goes_with_close():
    server = _serve(_echo)
    directory = os.path.dirname(server.address)
    assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
    assert stat.S_ISSOCK(os.stat(server.address).st_mode)
    server.close()
    assert not os.path.exists(directory)

    async def main():
        with pytest.raises(ServingError, match="target_verifier: cannot connect to its socket"):
            await SocketCallClient.connect("target_verifier", server.address)

    asyncio.run(main())


def test_a_socket_path_too_long_for_unix_sockets_is_refused_by_name(monkeypatch, tmp_path):
    deep = tmp_path / ("d" * 120)
    deep.mkdir()
    monkeypatch.setenv("TMPDIR", str(deep))
    monkeypatch.setattr("tempfile.tempdir", None)
    with pytest.raises(ValueError, match="target_verifier: the socket path .* is longer than 107 bytes; set TMPDIR"):
        _serve(_echo)
    assert list(deep.iterdir()) == []  # nothing left behind


def test_the_stages_call_the_stateful_models_on_their_sockets_and_keep_a_working_connection():
    servers = {model: _serve(_echo) for model in (wire.DRAFT_PROPOSER, wire.TARGET_VERIFIER)}
    try:
        async def main():
            stages = DraftInItsOwnModel(ModelLogger("speculative_decoding"), "secret", stage_calls="socket")
            addresses = {model: server.address for model, server in servers.items()}
            await stages._connect(addresses)
            assert set(stages._sockets) == set(addresses)
            target = stages._sockets[wire.TARGET_VERIFIER]
            out = await stages._call(wire.TARGET_VERIFIER, {"x": np.array([3])}, ["doubled"])
            assert out["doubled"].tolist() == [6]
            await stages._connect(addresses)  # described again (after a recovery): the same socket, kept
            assert stages._sockets[wire.TARGET_VERIFIER] is target
            await stages._connect({**addresses, wire.TARGET_VERIFIER: None})  # a model with no socket: BLS
            assert set(stages._sockets) == {wire.DRAFT_PROPOSER} and target.broken
            stages.close()
            assert not stages._sockets

            by_bls = DraftInItsOwnModel(ModelLogger("speculative_decoding"), "secret", stage_calls="bls")
            await by_bls._connect(addresses)
            assert not by_bls._sockets

        asyncio.run(main())
    finally:
        for server in servers.values():
            server.close()


class _Metric:
    def __init__(self):
        self.value, self.updates = 0.0, 0

    def increment(self, amount):
        self.value += amount
        self.updates += 1


class _Family:
    COUNTER = "counter"
    made: dict = {}

    def __init__(self, name, description, kind):
        self.name = name

    def Metric(self, labels):
        return _Family.made.setdefault((self.name, labels["model"]), _Metric())


def test_socket_call_time_is_sent_at_most_every_interval_and_at_every_release():
    now = [0.0]
    _Family.made = {}
    time_ = SocketCallTime("target_verifier", family_type=_Family, flush_interval_s=0.5, clock=lambda: now[0])
    calls = _Family.made[("spec_decode_socket_calls", "target_verifier")]
    seconds = _Family.made[("spec_decode_socket_call_seconds", "target_verifier")]
    for _ in range(3):
        time_.add(0.002)
    assert calls.updates == 0  # summed, not sent: each update is a round trip to the server
    now[0] = 0.6
    time_.add(0.002)
    assert (calls.value, seconds.value, calls.updates) == (4, pytest.approx(0.008), 1)
    time_.add(0.001, flush=True)  # a release: the request ends, its calls are counted before its answer
    assert (calls.value, seconds.value, calls.updates) == (5, pytest.approx(0.009), 2)


def test_a_model_removes_the_socket_directories_its_dead_predecessors_left(monkeypatch):
    tmp_path = Path(tempfile.mkdtemp(prefix="sc", dir="/tmp"))  # pytest's own is too deep for a socket path
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr("tempfile.tempdir", None)
    dead = tmp_path / "specdec-target_verifier-999999999-abc"  # no such process
    living = tmp_path / f"specdec-target_verifier-{os.getppid()}-abc"
    other_model = tmp_path / "specdec-draft_proposer-999999999-abc"
    for directory in (dead, living, other_model):
        directory.mkdir()
    server = _serve(_echo)
    try:
        assert not dead.exists() and living.exists() and other_model.exists()
        assert os.path.basename(os.path.dirname(server.address)).startswith(f"specdec-target_verifier-{os.getpid()}-")
    finally:
        server.close()
        shutil.rmtree(tmp_path)


def test_a_malformed_frame_closes_its_connection_and_the_server_keeps_answering_others():
    server = _serve(_echo)
    try:
        raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        raw.connect(server.address)
        raw.sendall((5).to_bytes(4, "little") + b"{not}")
        raw.settimeout(5)
        assert raw.recv(16) == b""  # closed, nothing answered
        raw.close()

        async def main():
            client = await SocketCallClient.connect("target_verifier", server.address)
            try:
                return await client.call({"x": np.array([4])}, ["doubled"])
            finally:
                client.close()

        assert asyncio.run(main())["doubled"].tolist() == [8]
    finally:
        server.close()


def test_a_model_that_unloads_tells_the_waiting_call_why_and_refuses_later_ones():
    entered, release = threading.Event(), threading.Event()

    def slow(inputs, output_names):
        entered.set()
        release.wait(5)
        return {"doubled": inputs["x"] * 2}

    server = _serve(slow)

    async def main():
        client = await SocketCallClient.connect("target_verifier", server.address)
        waiting = asyncio.ensure_future(client.call({"x": np.array([1])}, ["doubled"]))
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 5)
        server.close()  # the model's finalize, while a call is in its forward
        release.set()
        with pytest.raises(ServingError, match=r"target_verifier is unloading \(the server is shutting down, or "
                                               r"reloading the model\); the call was not answered"):
            await waiting
        with pytest.raises(ServingError, match="target_verifier is unloading"):
            await client.call({"x": np.array([1])}, ["doubled"])
        client.close()

    asyncio.run(main())


def test_a_draft_beside_the_target_is_described_on_target_verifiers_socket_and_needs_it(monkeypatch):
    """run_with_target: the draft's description comes from target_verifier's socket; without socket calls, a clear error."""
    from specdec.types import ModelDescription
    from specdec_triton import beside_wire, hidden_wire, model_stages

    head = ModelDescription("/m/head", 64, 128, 4, "eagle3", hidden_state_layers=(1, 3, 5))
    target = ModelDescription("/m/target", 64, 128, 4, "target")

    def answer(inputs, output_names):
        assert beside_wire.is_describe_draft(inputs)
        return {**wire.description_outputs(head), **hidden_wire.description_hidden_outputs(head),
                **wire.settings_outputs(head)}  # fmt: skip

    server = _serve(answer)

    async def bls(model, inputs, names, batched=False):
        assert model != wire.DRAFT_PROPOSER, "draft_proposer holds nothing beside the target: it is not asked"
        described = target if model == wire.TARGET_VERIFIER else ModelDescription(f"/m/{model}", 64, None, None, "x")
        return {**wire.description_outputs(described), **wire.socket_outputs(server.address)}

    monkeypatch.setattr(model_stages, "bls", bls)
    monkeypatch.setattr(model_stages, "ensure_bls_threads", lambda n: None)
    try:
        async def main():
            stages = DraftWithTheTarget(ModelLogger("speculative_decoding"), "secret")
            descriptions = await stages.describe()
            assert descriptions.draft == head and descriptions.target == target and stages.capabilities.proposes_in_verify
            assert stages._stateful == (wire.TARGET_VERIFIER,)  # its releases free the draft too
            stages.close()
            by_bls = DraftWithTheTarget(ModelLogger("speculative_decoding"), "secret", stage_calls="bls")
            with pytest.raises(ServingError, match="run_with_target, whose steps go to target_verifier's socket, "
                                                   "and stage_calls is 'bls'"):  # fmt: skip
                await by_bls.describe()

        asyncio.run(main())
    finally:
        server.close()
