"""Step calls to the stateful models over a Unix socket instead of a BLS request.

A BLS request from the orchestrator to target_verifier or draft_proposer costs about
1 ms on a CPU server before any model code runs (the request and response cross the
Triton server process twice, and the Python backend's handover runs both ways): a
third of a one-stream step on a model whose forward takes 2-4 ms (docs/benchmarks.md).
The orchestrator and these models are processes of one server on one host, so each
stateful model also listens on a Unix socket, in a directory only the server's user
can open, and states its path in its describe answer. With ``stage_calls: socket``
(the default) the orchestrator sends the same inputs there that a BLS request would
carry and reads the same outputs back, for well under half the BLS request's cost
(docs/scheduling.md#step-calls-on-a-socket). Triton still loads, watches and reloads the models, and every other
call (tokenize, describe, the models' calls to rejection_sampler) stays a BLS request.

A frame is ``u32 header length``, a JSON header, then each array's bytes in order. The
header of a call names the outputs wanted; of an answer, either the arrays or the
error (its message and its kind: the caller's input, the model unavailable, or internal).
A model that unloads sends every open connection one last frame that says so (``closing``)
instead of just going away, so the calls waiting on it end with the reason. Arrays of Triton's BYTES
type (numpy object arrays of bytes) travel as their items' lengths in the header and
the items concatenated. No pickle: a frame is data only.
"""
from __future__ import annotations

import asyncio
import collections
import json
import os
import shutil
import socket
import struct
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence

import numpy as np

from specdec_triton.internal import remove_dead_socket_directories
from specdec_triton.plumbing import ModelLogger, RequestError, ServingError

_LENGTH = struct.Struct("<I")  # the header's length
_MAX_SOCKET_PATH = 107  # sun_path holds 108 bytes with the terminating zero
# what a model's socket tells the calls it will not answer when the model unloads
UNLOADING = "{model} is unloading (the server is shutting down, or reloading the model)"
# an answer's error by kind, raised again on the caller's side as the model raised it, so that
# the request's final error has the code a BLS error response would have given it
_ERROR_KINDS = {"unavailable": ServingError, "invalid": RequestError, "internal": RuntimeError}

Arrays = Mapping[str, np.ndarray]
# (one call's inputs, the outputs wanted) -> the outputs (others are dropped); raises to answer with an error
Handler = Callable[[dict[str, np.ndarray], Sequence[str]], Arrays]


def encode(header: dict, arrays: Arrays | None = None) -> list[bytes | memoryview]:
    """A frame as the buffers to send, in order: no array is copied into one buffer."""
    specs, buffers = [], []
    for name, array in (arrays or {}).items():
        array = np.asarray(array)
        if array.dtype == np.object_:
            items = [item if isinstance(item, bytes) else str(item).encode() for item in array.reshape(-1)]
            specs.append([name, "bytes", list(array.shape), [len(item) for item in items]])
            buffers.append(b"".join(items))
        else:
            array = np.ascontiguousarray(array)
            specs.append([name, array.dtype.str, list(array.shape), array.nbytes])
            buffers.append(memoryview(array.reshape(-1)).cast("B"))
    head = json.dumps({**header, "arrays": specs}).encode()
    return [_LENGTH.pack(len(head)), head, *buffers]


def body_length(header: dict) -> int:
    """How many bytes of arrays follow ``header``."""
    return sum(sum(size) if dtype == "bytes" else size for _, dtype, _, size in header["arrays"])


def decode_arrays(header: dict, body: bytes | bytearray | memoryview) -> dict[str, np.ndarray]:
    """The arrays of a frame whose header is ``header`` and whose array bytes are ``body``."""
    arrays, offset, view = {}, 0, memoryview(body)
    for name, dtype, shape, size in header["arrays"]:
        if dtype == "bytes":
            items = np.empty(len(size), dtype=np.object_)
            for i, length in enumerate(size):
                items[i] = bytes(view[offset:offset + length])
                offset += length
            arrays[name] = items.reshape(shape)
        else:
            arrays[name] = np.frombuffer(body, dtype=np.dtype(dtype), count=size // np.dtype(dtype).itemsize,
                                         offset=offset).reshape(shape)  # fmt: skip
            offset += size
    return arrays


# --- the model's side ----------------------------------------------------------------------------


class SocketCallServer:
    """Answers calls on a Unix socket with ``handler``, one thread per connection.

    The orchestrator keeps one connection; a reloaded orchestrator opens a new one. The
    handler runs on these threads, beside the stub's own ``execute``: the model must
    serialize the two (:class:`specdec_triton.stateful.SequenceHost` holds a lock).
    """

    def __init__(self, name: str, handler: Handler, logger: ModelLogger):
        self.name, self.handler, self.logger = name, handler, logger
        remove_dead_socket_directories(name)  # earlier processes of this model that died without close
        # mode 0700: the server's user only; named by this process, so a successor can tell it is gone
        self._directory = tempfile.mkdtemp(prefix=f"specdec-{name}-{os.getpid()}-")
        self.address = os.path.join(self._directory, "calls.sock")
        if len(self.address.encode()) > _MAX_SOCKET_PATH:
            shutil.rmtree(self._directory, ignore_errors=True)
            raise ValueError(f"{name}: the socket path {self.address!r} is longer than {_MAX_SOCKET_PATH} bytes; "
                             f"set TMPDIR to a shorter directory or stage_calls to bls")  # fmt: skip
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.address)
        self._listener.listen(4)
        self._closed = False
        self._connections: dict[socket.socket, threading.Lock] = {}  # each open connection and its sending lock
        threading.Thread(target=self._accept, name=f"specdec-{name}-socket", daemon=True).start()

    def close(self) -> None:
        """Stop listening, and tell each connection why before closing it: the model is unloading."""
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        shutil.rmtree(self._directory, ignore_errors=True)
        closing = b"".join(encode({"closing": UNLOADING.format(model=self.name)}))
        for connection, sending in list(self._connections.items()):
            with sending:
                try:
                    connection.sendall(closing)
                    connection.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def _accept(self) -> None:
        while not self._closed:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._serve, args=(connection,), name=f"specdec-{self.name}-call",
                             daemon=True).start()  # fmt: skip

    def _serve(self, connection: socket.socket) -> None:
        sending = self._connections[connection] = threading.Lock()
        try:
            with connection:
                self._answer_until_closed(connection, sending)
        finally:
            self._connections.pop(connection, None)

    def _answer_until_closed(self, connection: socket.socket, sending: threading.Lock) -> None:
        while True:
            try:
                header, body = _receive(connection)
            except (ConnectionError, OSError):
                return  # the orchestrator went away: its sequences are released by their leases
            except ValueError as err:  # not a frame of ours: nothing after it can be read either
                self.logger.error(f"closing a socket connection that sent a malformed frame: {err}")
                return
            if header is None:
                return
            answer = b"".join(self._answer(header, body))
            with sending:
                try:
                    connection.sendall(answer)
                except OSError:
                    return  # closed while answering

    def _answer(self, header: dict, body: bytearray) -> list:
        try:
            outputs = self.handler(decode_arrays(header, body), header["outputs"])
            return encode({}, {name: outputs[name] for name in header["outputs"] if name in outputs})
        except Exception as err:  # the caller gets it, as a BLS caller gets an error response
            kind = "unavailable" if isinstance(err, ServingError) else "invalid" if isinstance(err, ValueError) else "internal"
            message = str(err) if kind != "internal" else f"{type(err).__name__}: {err}"
            return encode({"error": message, "kind": kind})


def _receive(connection: socket.socket) -> tuple[dict | None, bytearray]:
    """One frame, or ``(None, ...)`` when the peer closed the connection between frames."""
    prefix = _read_exactly(connection, _LENGTH.size, allow_eof=True)
    if prefix is None:
        return None, bytearray()
    header = json.loads(_read_exactly(connection, _LENGTH.unpack(prefix)[0]))
    return header, _read_exactly(connection, body_length(header))


def _read_exactly(connection: socket.socket, size: int, allow_eof: bool = False) -> bytearray | None:
    buffer, received = bytearray(size), 0
    view = memoryview(buffer)
    while received < size:
        n = connection.recv_into(view[received:])
        if n == 0:
            if allow_eof and received == 0:
                return None
            raise ConnectionError("the peer closed the connection inside a frame")
        received += n
    return buffer


# --- the orchestrator's side ---------------------------------------------------------------------


class SocketCallClient:
    """The orchestrator's connection to one model: calls answered in the order they were sent.

    A call's frame is written at once, before the caller first waits, so a step's call
    leaves before whatever else the event loop has ready (streaming the last step's
    text, say) runs. One reader task takes the answers in order, each for the oldest
    call still waiting: a caller cancelled while it waits leaves its answer to be read
    and dropped, and the next call's answer is still its own.
    """

    def __init__(self, model_name: str, address: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.model_name, self.address, self._reader, self._writer = model_name, address, reader, writer
        self._waiting: collections.deque[tuple[asyncio.Future, list[str]]] = collections.deque()  # oldest first
        self.broken: str | None = None  # why the connection cannot be used any more
        self._reading = asyncio.ensure_future(self._read_answers())

    @classmethod
    async def connect(cls, model_name: str, address: str) -> SocketCallClient:
        try:
            reader, writer = await asyncio.open_unix_connection(address, limit=2**26)
        except OSError as err:
            raise ServingError(f"{model_name}: cannot connect to its socket {address!r}: {err}") from None
        return cls(model_name, address, reader, writer)

    async def call(self, inputs: Arrays, output_names: Sequence[str]) -> dict[str, np.ndarray]:
        """The model's outputs ``output_names`` for ``inputs``; its error raised again here, named."""
        if self.broken:
            raise ServingError(self.broken)
        answer = asyncio.get_running_loop().create_future()
        self._waiting.append((answer, list(output_names)))
        try:
            self._writer.writelines(encode({"outputs": list(output_names)}, inputs))
            await self._writer.drain()
        except (ConnectionError, OSError) as err:
            self._fail(self._closed_message(err))
        return await answer

    async def _read_answers(self) -> None:
        try:
            while True:
                prefix = await self._reader.readexactly(_LENGTH.size)
                header = json.loads(await self._reader.readexactly(_LENGTH.unpack(prefix)[0]))
                body = bytearray(await self._reader.readexactly(body_length(header)))  # writable, as BLS outputs are
                if "closing" in header:  # the model is unloading: no answer will come for any call
                    self._fail(f"{header['closing']}; the call was not answered")
                    return
                answer, output_names = self._waiting.popleft()
                if not answer.done():  # not cancelled
                    _settle(answer, self.model_name, header, body, output_names)
        except (ConnectionError, OSError, asyncio.IncompleteReadError, IndexError, ValueError) as err:
            self._fail(self._closed_message(err))
        except asyncio.CancelledError:
            self._fail(self.broken or f"{self.model_name}: the connection was closed")

    def _closed_message(self, err: BaseException) -> str:
        return f"{self.model_name} stopped: the connection to its process closed ({type(err).__name__})"

    def _fail(self, why: str) -> None:
        self.broken = why
        self._writer.close()
        while self._waiting:
            answer, _ = self._waiting.popleft()
            if not answer.done():
                answer.set_exception(ServingError(why))

    def close(self) -> None:
        self.broken = self.broken or f"{self.model_name}: the connection was closed"
        self._reading.cancel()
        self._writer.close()


def _settle(answer: asyncio.Future, model_name: str, header: dict, body: bytearray, output_names: list[str]) -> None:
    if "error" in header:
        answer.set_exception(_ERROR_KINDS[header["kind"]](f"{model_name}: {header['error']}"))
        return
    outputs = decode_arrays(header, body)
    missing = [name for name in output_names if name not in outputs]
    if missing:
        answer.set_exception(RuntimeError(f"{model_name}: the answer lacks the requested output(s) {missing}"))
    else:
        answer.set_result(outputs)
