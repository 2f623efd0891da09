"""Hostile peers of the event ports that speak ZMTP 3.0 by hand and never read: plain TCP
sockets, no ZMQ library (stdlib only: the tests run this as another uid).

    python zmtp_peer.py EVENTS REPLAY GREETERS SUBSCRIBERS REQUESTERS REQUESTS

* GREETERS connect to each port, send the greeting and nothing else (a handshake that
  never ends);
* SUBSCRIBERS connect to the PUB as a SUB: greeting, READY, a subscription to everything;
* REQUESTERS connect to the replay ROUTER as a DEALER: greeting, READY, REQUESTS replay
  requests from sequence 0.

Beyond the handshake (the server's greeting and READY: a message sent before it is a
protocol error) none of them ever reads. It prints ``ready`` once all is sent, then waits
for its stdin to close, closes every socket and exits. A connection the server closes
during the handshake (past its connection cap) is given up and counted
(``ready refused=N``). ZMTP 3.1, NULL mechanism
(rfc.zeromq.org/spec/37; a subscription as the 3.0 message libzmq still takes):

    greeting  0xFF, 7 x 0x00, 0x01, 0x7F, version 3 1, "NULL" padded to 20, as-server 0,
              31 x 0x00
    command   0x04, size (1 byte), name-size, name, properties (name-size, name,
              value-size (4 bytes, big-endian), value)
    frame     flags (0x01: more follows), size (1 byte), body
"""

from __future__ import annotations

import socket
import sys

GREETING = (b"\xff" + b"\0" * 7 + b"\x01\x7f" + b"\x03\x01" + b"NULL".ljust(20, b"\0") + b"\0"
            + b"\0" * 31)


def ready(socket_type: bytes) -> bytes:
    body = (b"\x05READY" + b"\x0bSocket-Type" + len(socket_type).to_bytes(4, "big")
            + socket_type)
    return b"\x04" + bytes([len(body)]) + body


def frame(body: bytes, more: bool = False) -> bytes:
    return bytes([1 if more else 0, len(body)]) + body


def connect(endpoint: str) -> socket.socket:
    host, port = endpoint[len("tcp://"):].rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=30)


def handshake(sock: socket.socket, socket_type: bytes) -> None:
    """Greeting and READY both ways; nothing of the server's is read past its READY."""
    sock.sendall(GREETING + ready(socket_type))
    _read(sock, len(GREETING))
    flags, size = _read(sock, 2)
    assert flags == 0x04, f"expected the server's READY command, got flags {flags:#x}"
    _read(sock, size)


def _read(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the server closed during the handshake")
        data += chunk
    return data


def main(argv: list[str]) -> int:
    events, replay = argv[0], argv[1]
    greeters, subscribers, requesters, requests = (int(a) for a in argv[2:6])
    held, refused = [], 0
    for _ in range(greeters):
        for endpoint in (events, replay):
            sock = connect(endpoint)
            sock.sendall(GREETING)
            held.append(sock)
    request = frame(b"", more=True) + frame((0).to_bytes(8, "big"))
    for endpoint, kind, then in ([(events, b"SUB", frame(b"\x01"))] * subscribers  # all
                                 + [(replay, b"DEALER", request * requests)] * requesters):
        sock = connect(endpoint)
        try:
            handshake(sock, kind)
            sock.sendall(then)
        except OSError:
            sock.close()
            refused += 1
            continue
        held.append(sock)
    print(f"ready refused={refused}", flush=True)
    sys.stdin.read()
    for sock in held:
        sock.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
