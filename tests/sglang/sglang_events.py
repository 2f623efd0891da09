"""A router's view of the node's event stream through SGLang 0.5.23's own classes: batches
decoded with its ``KVEventBatch`` (as a router reading SGLang's KV events decodes them),
and the events SGLang itself would publish for a prefix, from its ``KVCacheEventRecorder``
over a radix-tree node of those tokens (SGLang's hashing, not a re-derivation)."""

from __future__ import annotations

import time
from array import array
from typing import Any

import msgspec
import zmq
from sglang.srt.disaggregation.kv_events import KVEventBatch, StorageMedium
from sglang.srt.mem_cache.events import KVCacheEventRecorder
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

END_SEQ = (-1).to_bytes(8, "big", signed=True)
WAIT_S = 60.0
REPLAY_TIMEOUT_MS = 2000


def sglang_events(tokens: list[int], page_size: int,
                  medium: StorageMedium = StorageMedium.CPU) -> list[Any]:
    """The ``BlockStored`` events SGLang publishes for ``tokens`` (whole pages) inserted
    under the root of its radix tree, in ``medium``."""
    root = TreeNode()
    root.key, root.hash_value = RadixKey(array("q")), []
    node = TreeNode()
    node.parent, node.key = root, RadixKey(array("q", tokens))
    recorder = KVCacheEventRecorder(enabled=True, page_size=page_size)
    recorder.record_store(node, medium=medium)
    return recorder.take()


class SGLangSubscriber:
    """SUB + replay DEALER on the node's stream; ``batches`` by sequence number, each
    (topic, SGLang's decoded ``KVEventBatch``)."""

    def __init__(self, endpoint: str, replay: str):
        self.context = zmq.Context()
        self.sub = self.context.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(endpoint)
        self.dealer = self.context.socket(zmq.DEALER)
        self.dealer.setsockopt(zmq.RCVTIMEO, REPLAY_TIMEOUT_MS)
        self.dealer.connect(replay)
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.batches: dict[int, tuple[str, KVEventBatch]] = {}

    def _take(self, topic: bytes, seq: bytes, payload: bytes) -> None:
        self.batches[int.from_bytes(seq, "big")] = (topic.decode(), self.decoder.decode(payload))

    def _replay(self) -> None:
        """Everything after the last batch in order (a live batch may have come before the
        subscription reached the publisher: ZMQ's slow joiner)."""
        start = 0
        while start in self.batches:
            start += 1
        self.dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while True:
            try:
                _, topic, seq, payload = self.dealer.recv_multipart()
            except zmq.Again:
                return
            if seq == END_SEQ:
                return
            self._take(topic, seq, payload)

    def events(self, kind: type) -> list[tuple[str, Any]]:
        return [(topic, e) for _, (topic, batch) in sorted(self.batches.items())
                for e in batch.events if isinstance(e, kind)]

    def until(self, condition: Any, wait_s: float = WAIT_S) -> None:
        """Read (live, and replays of what was missed) until ``condition(self)`` holds."""
        deadline = time.monotonic() + wait_s
        self._replay()
        while not condition(self):
            assert time.monotonic() < deadline, (
                f"subscriber condition not met within {wait_s} s; batches {self.batches}")
            if self.sub.poll(100):
                self._take(*self.sub.recv_multipart())
            else:
                self._replay()

    def close(self) -> None:
        for sock in (self.sub, self.dealer):
            sock.close(linger=0)
        self.context.term()
