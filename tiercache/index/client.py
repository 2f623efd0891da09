"""``Client``: the cache index of a running coordinator, with the manager's methods.

One connection, one call at a time (a lock serialises threads). When the
coordinator is gone a call raises ``CoordinatorGoneError``; the next call connects
again. A call interrupted that way may or may not have taken effect on the
coordinator (the request may have arrived before the connection broke), so the
client never retries on its own.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Sequence

from tiercache.config import Config
from tiercache.errors import ConfigError, ControlSocketError, CoordinatorGoneError, ProtocolError
from tiercache.index.manager import ManagerStats, OffloadingEvent, PrepareStoreOutput
from tiercache.index.protocol import (
    HEADER_BYTES, MAX_KEYS_PER_CALL, MAX_SOCKET_PATH_BYTES, FrameHeader, PayloadReader,
    PayloadWriter, Status, Verb, decode_error, decode_events, decode_stats, decode_store_output,
    frame,
)
from tiercache.specs import CPULoadStoreSpec

DEFAULT_TIMEOUT_S = 10.0
_RECV_BYTES = 64 << 10  # below malloc's mmap threshold: no mmap per call
_REQUEST_ID_MOD = 1 << 32


class Client:
    """Talks to the coordinator serving ``config_or_socket_path`` (a ``Config`` or a path)."""

    def __init__(self, config_or_socket_path: Config | str | os.PathLike[str],
                 timeout_s: float = DEFAULT_TIMEOUT_S):
        if isinstance(config_or_socket_path, Config):
            self._path = config_or_socket_path.socket_path
        else:
            self._path = os.fspath(config_or_socket_path)
        if len(os.fsencode(self._path)) > MAX_SOCKET_PATH_BYTES:
            raise ControlSocketError(
                f"control socket path {self._path!r} is {len(os.fsencode(self._path))} bytes; "
                f"Unix sockets allow at most {MAX_SOCKET_PATH_BYTES}"
            )
        if not timeout_s > 0:
            raise ConfigError(f"timeout_s = {timeout_s!r}: must be > 0")
        self._timeout_s = float(timeout_s)
        self._sock: socket.socket | None = None
        self._inbuf = bytearray()
        self._next_id = 1
        self._lock = threading.Lock()

    @property
    def socket_path(self) -> str:
        return self._path

    # ------------------------------------------------------------------ the manager's verbs

    def lookup(self, keys: Sequence[bytes]) -> int:
        reader = self._call(Verb.LOOKUP, PayloadWriter().keys(keys).build())
        hits = reader.u32()
        reader.done()
        return hits

    def prepare_load(self, keys: Sequence[bytes]) -> CPULoadStoreSpec:
        reader = self._call(Verb.PREPARE_LOAD, PayloadWriter().keys(keys).build())
        ids = reader.ids()
        reader.done()
        if len(ids) != len(keys):
            raise ProtocolError(
                f"prepare_load: asked for {len(keys)} keys, got {len(ids)} slot ids")
        return CPULoadStoreSpec(ids)

    def touch(self, keys: Sequence[bytes]) -> None:
        self._call(Verb.TOUCH, PayloadWriter().keys(keys).build()).done()

    def complete_load(self, keys: Sequence[bytes]) -> None:
        self._call(Verb.COMPLETE_LOAD, PayloadWriter().keys(keys).build()).done()

    def prepare_store(self, keys: Sequence[bytes]) -> PrepareStoreOutput | None:
        reader = self._call(Verb.PREPARE_STORE, PayloadWriter().keys(keys).build())
        out = decode_store_output(reader)
        reader.done()
        return out

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        payload = PayloadWriter().u8(1 if success else 0).keys(keys).build()
        self._call(Verb.COMPLETE_STORE, payload).done()

    def take_events(self) -> list[OffloadingEvent]:
        """Every pending event, fetched in as many calls as the frame bound needs."""
        events: list[OffloadingEvent] = []
        while True:
            reader = self._call(Verb.TAKE_EVENTS, b"")
            batch = decode_events(reader)
            reader.done()
            events.extend(batch)
            if sum(len(e.keys) for e in batch) < MAX_KEYS_PER_CALL:
                return events

    def reset(self) -> None:
        self._call(Verb.RESET, b"").done()

    def stats(self) -> ManagerStats:
        reader = self._call(Verb.STATS, b"")
        stats = decode_stats(reader)
        reader.done()
        return stats

    def ping(self) -> float:
        """Round-trip time in seconds; raises ``CoordinatorGoneError`` if nobody answers."""
        start = time.perf_counter()
        self._call(Verb.PING, b"").done()
        return time.perf_counter() - start

    def close(self) -> None:
        with self._lock:
            self._disconnect()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ transport

    def _call(self, verb: Verb, payload: bytes) -> PayloadReader:
        with self._lock:
            request_id = self._next_id
            self._next_id = (request_id + 1) % _REQUEST_ID_MOD
            sock = self._connected()
            try:
                sock.sendall(frame(verb, request_id, payload))
                header, body = self._read_frame(sock)
            except (OSError, EOFError) as e:  # timeouts included: the stream is out of step
                self._disconnect()
                raise CoordinatorGoneError(
                    f"coordinator on {self._path} went away during {verb.name}: "
                    f"{e or type(e).__name__}"
                ) from e
            except ProtocolError:
                self._disconnect()
                raise
            if header.verb is not verb or header.request_id != request_id:
                self._disconnect()
                raise ProtocolError(
                    f"answer for {header.verb.name} #{header.request_id} to request "
                    f"{verb.name} #{request_id}"
                )
        reader = PayloadReader(body)
        if header.status is Status.ERROR:
            error = decode_error(reader)
            raise error
        return reader

    def _connected(self) -> socket.socket:
        if self._sock is not None:
            return self._sock
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self._timeout_s)
        try:
            sock.connect(self._path)
        except OSError as e:
            sock.close()
            raise CoordinatorGoneError(
                f"no coordinator on {self._path} ({e.strerror or e}); start one with "
                "`tiercache serve --config FILE`"
            ) from e
        self._sock = sock
        self._inbuf = bytearray()
        return sock

    def _disconnect(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._inbuf = bytearray()

    def _read_frame(self, sock: socket.socket) -> tuple[FrameHeader, bytes | memoryview]:
        buf = self._inbuf
        if not buf:  # usual case: the whole answer arrives in one piece
            chunk = sock.recv(_RECV_BYTES)
            if not chunk:
                raise EOFError("connection closed by the coordinator")
            if len(chunk) >= HEADER_BYTES:
                header = FrameHeader.unpack(chunk)
                if len(chunk) == HEADER_BYTES + header.payload_bytes:
                    return header, memoryview(chunk)[HEADER_BYTES:]
            buf += chunk
        while True:
            need_bytes = HEADER_BYTES
            if len(buf) >= HEADER_BYTES:
                header = FrameHeader.unpack(buf)
                need_bytes = HEADER_BYTES + header.payload_bytes
                if len(buf) >= need_bytes:
                    body = bytes(buf[HEADER_BYTES:need_bytes])
                    del buf[:need_bytes]
                    return header, body
            chunk = sock.recv(max(_RECV_BYTES, need_bytes - len(buf)))
            if not chunk:
                raise EOFError("connection closed by the coordinator")
            buf += chunk
