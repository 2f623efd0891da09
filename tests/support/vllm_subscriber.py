"""A KV-event subscriber written for vLLM 0.33, run in ``.venv-vllm``: it imports vLLM's own
``KVEventBatch`` and nothing of tiercache, so what it decodes, a router written for vLLM
decodes.

    python vllm_subscriber.py ENDPOINT [REPLAY_ENDPOINT] [--topic PREFIX] [--no-replay]

Connects a SUB socket (and a DEALER to the replay endpoint), replays from sequence 0 once
connected, then reads live batches; a gap in the sequence numbers is filled by a replay
from the first missing one. Prints one JSON line per batch, in sequence order, never the
same sequence twice: ``{"topic", "seq", "ts", "replayed", "events": [...]}``, each event
``msgspec.to_builtins`` of vLLM's struct with its ``"type"`` (bytes hashes as hex). A
batch vLLM's decoder rejects is printed as ``{"seq", "error"}``. Reads stdin: any line asks
for a replay from 0 again ("REPLAY"), EOF stops it.
"""

from __future__ import annotations

import argparse
import json
import select
import sys

import msgspec
import zmq
from vllm.distributed.kv_events import KVEventBatch

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _builtin(value):
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, list):
        return [_builtin(v) for v in value]
    return value


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("endpoint")
    parser.add_argument("replay", nargs="?")
    parser.add_argument("--topic", default="")
    parser.add_argument("--no-replay", action="store_true")
    parser.add_argument("--rcvhwm", type=int, default=0)
    args = parser.parse_args()
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    context = zmq.Context()
    sub = context.socket(zmq.SUB)
    if args.rcvhwm:
        sub.setsockopt(zmq.RCVHWM, args.rcvhwm)
    sub.setsockopt(zmq.SUBSCRIBE, args.topic.encode())
    sub.connect(args.endpoint)
    dealer = None
    if args.replay:
        dealer = context.socket(zmq.DEALER)
        dealer.connect(args.replay)
    seen: set[int] = set()
    last = -1

    def emit(frames, replayed: bool) -> None:
        nonlocal last
        topic, seq_bytes, payload = frames
        seq = int.from_bytes(seq_bytes, "big")
        if seq in seen:
            return
        seen.add(seq)
        last = max(last, seq)
        try:
            batch = decoder.decode(payload)
        except msgspec.DecodeError as e:
            print(json.dumps({"seq": seq, "error": str(e)}), flush=True)
            return
        events = []
        for event in batch.events:
            body = {k: _builtin(v) for k, v in msgspec.to_builtins(event).items()}
            body["type"] = type(event).__name__
            events.append(body)
        print(json.dumps({"topic": topic.decode(), "seq": seq, "ts": batch.ts,
                          "dp_rank": batch.data_parallel_rank, "replayed": replayed,
                          "events": events}), flush=True)

    def replay(start: int) -> None:
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            frames = dealer.recv_multipart()
            _, topic, seq_bytes, payload = frames
            if seq_bytes == END_SEQ:
                return
            emit([topic, seq_bytes, payload], True)

    if dealer is not None and not args.no_replay:
        replay(0)
    print(json.dumps({"ready": True}), flush=True)
    poller = zmq.Poller()
    poller.register(sub, zmq.POLLIN)
    while True:
        if select.select([sys.stdin], [], [], 0)[0]:
            line = sys.stdin.readline()
            if not line:
                return 0
            if dealer is not None:
                replay(0)
                print(json.dumps({"replayed_from": 0}), flush=True)
        if not poller.poll(50):
            continue
        frames = sub.recv_multipart()
        seq = int.from_bytes(frames[1], "big")
        if dealer is not None and not args.no_replay and last >= 0 and seq > last + 1:
            replay(last + 1)
        emit(frames, False)


if __name__ == "__main__":
    sys.exit(main())
