"""Version skew on the control plane (``tiercache.link.versions``), against a real
``tiercache serve``: an engine one protocol version older is served in its own version;
one older still, or one newer, is refused at HELLO in one line that it can read, and the
coordinator logs that line and keeps serving everyone else."""

from __future__ import annotations

import functools
import socket

import pytest

from control_support import SOCKET_TIMEOUT_S, closed_by_peer, keys_payload
from tiercache.config import RegionConfig
from tiercache.link import channel
from tiercache.link.client import Client
from tiercache.link.payloads import (
    decode_error, decode_hello, decode_store_output, encode_error, encode_hello_request,
    encode_store_request,
)
from tiercache.link.protocol import (
    HEADER_BYTES, PROTOCOL_VERSION, FrameHeader, PayloadReader, Status, Verb, frame,
)
from tiercache.link.versions import SERVED_VERSIONS, VERB_SINCE, error_code_for
from tiercache.errors import NamespaceError, ProtocolError
from tiercache.service.process import CoordinatorProcess

OLDER, NEWER = PROTOCOL_VERSION - 1, PROTOCOL_VERSION + 1


class RawEngine:
    """An engine speaking control protocol ``version`` by hand (today's payload codecs,
    which are those of every served version for the verbs it sends)."""

    def __init__(self, path: str, version: int):
        self.version = version
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(SOCKET_TIMEOUT_S)
        self.sock.connect(path)
        self._next_id = 1

    def call(self, verb: Verb, payload: bytes) -> tuple[FrameHeader, bytes]:
        request_id, self._next_id = self._next_id, self._next_id + 1
        self.sock.sendall(frame(verb, request_id, payload, version=self.version))
        header, body = self._read()
        assert header.request_id in (request_id, 0) and header.version == self.version
        return header, body

    def _read(self) -> tuple[FrameHeader, bytes]:
        data = b""
        while len(data) < HEADER_BYTES:
            chunk = self.sock.recv(1 << 16)
            assert chunk, "the coordinator closed the connection without an answer"
            data += chunk
        header = FrameHeader.unpack(data, self.version)  # any other version raises
        while len(data) < HEADER_BYTES + header.payload_bytes:
            data += self.sock.recv(1 << 16)
        return header, data[HEADER_BYTES:]

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def coordinator(make_config):
    config = make_config(region=RegionConfig(capacity_bytes=None, num_blocks=8,
                                             prefault_threads=1))
    with CoordinatorProcess(config) as coordinator:
        yield coordinator


def test_the_rule_is_n_and_n_minus_1():
    assert SERVED_VERSIONS == (PROTOCOL_VERSION - 1, PROTOCOL_VERSION)
    assert all(since <= PROTOCOL_VERSION for since in VERB_SINCE.values())


def test_an_engine_one_version_older_is_served_in_its_version(coordinator):
    path = coordinator.config.control_socket
    keys = [b"older-%d" % i for i in range(3)]
    engine = RawEngine(path, OLDER)
    try:
        header, body = engine.call(Verb.HELLO, encode_hello_request(None, "older engine"))
        assert header.status is Status.OK
        assert len(decode_hello(PayloadReader(body)).token) == 16
        header, body = engine.call(Verb.PREPARE_STORE, encode_store_request(keys, None))
        assert header.status is Status.OK
        out = decode_store_output(PayloadReader(body))
        assert out is not None and list(out.keys_to_store) == keys
        header, _ = engine.call(Verb.COMPLETE_STORE, b"\x01" + keys_payload(keys))
        assert header.status is Status.OK
        header, body = engine.call(Verb.LOOKUP, keys_payload(keys))
        assert header.status is Status.OK and PayloadReader(body).u32() == 3
        # what 9 added or reads another way is refused to it, and its connection stays
        for verb in VERB_SINCE:
            header, body = engine.call(verb, b"")
            assert (header.verb, header.status) == (verb, Status.ERROR)
            error = decode_error(PayloadReader(body))
            assert f"{verb.name} is served to control protocol" in str(error)
        header, body = engine.call(Verb.LOOKUP, keys_payload(keys[:1]))
        assert header.status is Status.OK and PayloadReader(body).u32() == 1
        # a frame of another version on its connection is a bad frame: closed, no answer
        engine.sock.sendall(frame(Verb.PING, 99, b""))
        assert closed_by_peer(engine.sock)
    finally:
        engine.close()
    with Client(coordinator.config) as current:  # one index: the older engine's blocks
        assert current.lookup(keys) == 3


@pytest.mark.parametrize("version", [OLDER - 1, NEWER, 255])
def test_an_engine_of_a_version_not_served_is_refused_at_hello_in_one_line(coordinator,
                                                                           version):
    engine = RawEngine(coordinator.config.control_socket, version)
    try:
        # a newer HELLO's payload may be anything: none of it is read
        header, body = engine.call(Verb.HELLO, b"\xff" * 40)
        assert (header.verb, header.status, header.request_id) == (Verb.HELLO, Status.ERROR, 0)
        error = decode_error(PayloadReader(body))
        assert type(error) is ProtocolError
        line = str(error)
        assert "\n" not in line
        assert f"engine speaks control protocol {version};" in line
        assert f"serves protocol {OLDER} and {PROTOCOL_VERSION}" in line
        assert ("upgrade the coordinator first" if version > PROTOCOL_VERSION
                else "upgrade the engine's tiercache") in line
        assert closed_by_peer(engine.sock)
    finally:
        engine.close()
    with Client(coordinator.config) as current:  # everyone else is served as ever
        current.ping()
    assert f"refused: {line}" in coordinator.output()  # the coordinator's side: its log


def test_a_newer_engines_client_raises_the_coordinators_line(coordinator, monkeypatch):
    """The engine's side: today's ``Client`` patched to speak N+1 gets the refusal as
    the exception of its first call, the coordinator's one line."""
    unpack = FrameHeader.unpack.__func__
    monkeypatch.setattr(channel, "frame", functools.partial(frame, version=NEWER))
    monkeypatch.setattr(FrameHeader, "unpack", classmethod(
        lambda cls, data, version=NEWER: unpack(cls, data, version)))
    with pytest.raises(ProtocolError) as refused:
        with Client(coordinator.config) as client:
            client.ping()
    assert str(refused.value).startswith(f"engine speaks control protocol {NEWER};")
    assert "\n" not in str(refused.value)


def test_error_codes_an_older_version_lacks_are_sent_as_unexpected():
    assert decode_error(PayloadReader(encode_error(NamespaceError("x")))).__class__ is \
        NamespaceError
    older = decode_error(PayloadReader(encode_error(NamespaceError("x"), OLDER)))
    assert type(older).__name__ == "TiercacheError" and str(older) == "x"
    assert error_code_for(6, OLDER) == 6
