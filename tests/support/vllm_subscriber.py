"""A KV-event subscriber written for vLLM 0.33, run in ``.venv-vllm``: it imports vLLM's own
``KVEventBatch`` and nothing of tiercache, so what it decodes, a router written for vLLM
decodes. Importing vLLM takes seconds, so one process serves a whole test module, told
what to do on stdin, one command per line:

* ``connect ENDPOINT REPLAY_ENDPOINT|- TOPIC|- [RCVHWM]``: (re)connect a SUB socket (and a
  DEALER to the replay endpoint), replay from sequence 0, print ``{"ready": true}``;
* ``replay START``: ask for a replay from START;
* ``pause`` / ``resume``: stop / start reading the SUB socket (a slow subscriber);
* EOF: exit.

Prints one JSON line per batch (each line carries ``conn``, the number of the connect
command it belongs to), never the same sequence number twice (per connection):
``{"topic", "seq", "ts", "dp_rank", "replayed", "events": [...]}``, each event vLLM's
struct as a dict (fields at None left out unless vLLM requires them) with its ``"type"``
(bytes hashes as hex). A gap
in the live sequence numbers is filled by a replay from the first missing one (what
vLLM's subscribers do) and reported as ``{"gap": [first, last]}``; so is a quiet stream's
tail (a batch sent before the subscription reached the publisher: ZMQ's slow joiner);
a batch vLLM's decoder rejects is ``{"seq", "error"}``.
"""

from __future__ import annotations

import faulthandler
import json
import signal
import sys

import msgspec
import zmq
from vllm.distributed.kv_events import KVEventBatch

END_SEQ = (-1).to_bytes(8, "big", signed=True)
# BlockStored's fields without defaults (always on the wire); the others shown when set
REQUIRED = {"block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
            "medium", "lora_name"}
IDLE_MS = 500
REPLAY_TIMEOUT_MS = 5000  # no live batch this long: ask for a replay of anything after the last one


def _builtin(value):
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list):
        return [_builtin(v) for v in value]
    return value


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


class Subscriber:
    def __init__(self) -> None:
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.context = zmq.Context()
        self.sub = self.dealer = None
        self.seen: set[int] = set()
        self.last = -1
        self.paused = False
        self.conn = 0  # which connect command the printed lines belong to
        self.topic = b""

    def connect(self, endpoint: str, replay: str, topic: str, rcvhwm: int) -> None:
        self.close()
        self.conn += 1
        self.sub = self.context.socket(zmq.SUB)
        if rcvhwm:
            self.sub.setsockopt(zmq.RCVHWM, rcvhwm)
            self.sub.setsockopt(zmq.RCVBUF, 4096)
        self.topic = topic.encode()
        self.sub.setsockopt(zmq.SUBSCRIBE, self.topic)
        self.sub.connect(endpoint)
        if replay != "-":
            self.dealer = self.context.socket(zmq.DEALER)
            self.dealer.setsockopt(zmq.RCVTIMEO, REPLAY_TIMEOUT_MS)
            self.dealer.setsockopt(zmq.SNDTIMEO, REPLAY_TIMEOUT_MS)
            self.dealer.connect(replay)
            self.replay(0)
        self.paused = False
        say(ready=True)

    def close(self) -> None:
        for sock in (self.sub, self.dealer):
            if sock is not None:
                sock.close(linger=0)
        self.sub = self.dealer = None
        self.seen, self.last = set(), -1

    def replay(self, start: int) -> None:
        self.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            try:
                _, topic, seq_bytes, payload = self.dealer.recv_multipart()
            except zmq.Again:  # the publisher is gone (or dropped the answer): carry on
                say(conn=self.conn, replay_timeout=start)
                return
            if seq_bytes == END_SEQ:
                return
            self.emit(topic, seq_bytes, payload, True)

    def emit(self, topic: bytes, seq_bytes: bytes, payload: bytes, replayed: bool) -> None:
        seq = int.from_bytes(seq_bytes, "big")
        if seq in self.seen:
            return
        self.seen.add(seq)
        self.last = max(self.last, seq)
        if not topic.startswith(self.topic):
            return  # a replay answers every topic: keep to ours, as SUB does live
        try:
            batch = self.decoder.decode(payload)
        except msgspec.DecodeError as e:
            say(conn=self.conn, seq=seq, error=str(e))
            return
        events = []
        for event in batch.events:
            body = {k: _builtin(v) for k, v in msgspec.structs.asdict(event).items()
                    if v is not None or k in REQUIRED}
            body["type"] = type(event).__name__
            events.append(body)
        say(conn=self.conn, topic=topic.decode(), seq=seq, ts=batch.ts,
            dp_rank=batch.data_parallel_rank, replayed=replayed, events=events)

    def on_live(self) -> None:
        topic, seq_bytes, payload = self.sub.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big")
        if self.dealer is not None and self.last >= 0 and seq > self.last + 1:
            say(conn=self.conn, gap=[self.last + 1, seq - 1])
            self.replay(self.last + 1)
        self.emit(topic, seq_bytes, payload, False)

    def command(self, line: str) -> None:
        words = line.split()
        if words[0] == "connect":
            topic = "" if words[3] == "-" else words[3]
            self.connect(words[1], words[2], topic, int(words[4]) if len(words) > 4 else 0)
        elif words[0] == "replay":
            self.replay(int(words[1]))
            say(replayed_from=int(words[1]))
        elif words[0] in ("pause", "resume"):
            self.paused = words[0] == "pause"
            say(paused=self.paused)


def main() -> int:
    faulthandler.register(signal.SIGUSR1)  # a stuck subscriber tells where (tests' debugging)
    subscriber = Subscriber()
    say(started=True)
    stdin = zmq.Poller()
    stdin.register(sys.stdin, zmq.POLLIN)
    while True:
        poller = zmq.Poller()
        poller.register(sys.stdin, zmq.POLLIN)
        if subscriber.sub is not None and not subscriber.paused:
            poller.register(subscriber.sub, zmq.POLLIN)
        ready = dict(poller.poll(IDLE_MS))
        if subscriber.sub is not None and ready.get(subscriber.sub):
            subscriber.on_live()
        elif not ready and subscriber.dealer is not None and not subscriber.paused:
            subscriber.replay(subscriber.last + 1)  # a quiet stream: fetch a missed tail
        if any(k is sys.stdin or k == sys.stdin.fileno() for k in ready):
            line = sys.stdin.readline()
            if not line:
                subscriber.close()
                return 0
            subscriber.command(line)


if __name__ == "__main__":
    sys.exit(main())
