"""What the node's KV event stream says tiercache holds: the prefix router's view of the
node cache in the tiercache arm.

``NodeStreamView`` subscribes to the running ``tiercache serve``'s stream as a router does
(docs/events.md): a ZMQ SUB socket on ``events.endpoint``, every batch decoded with vLLM's
own ``KVEventBatch``, and vLLM's replay protocol on ``events.replay_endpoint`` for a gap in
the sequence numbers. It keeps, per medium (``CPU``, ``STORAGE``), the block hashes the
node announced and has not removed, in vLLM's int form (``VLLM_KV_EVENTS_USE_INT_BLOCK_
HASHES``: the block hash's last 8 bytes), the form the engines' own events and the router
use. Every engine of the arm shares the node, so a block it holds counts for each of them.

**Read on the replay's clock.** The stream runs on wall time (a batch every
``batch_interval_s``), the replay on a simulated clock that may run far ahead of it. A
router that read whatever had arrived would see more or less of the node depending on the
machine's speed. So before each routing decision ``sync()`` waits (for events, never a
guessed time) until the view of host memory is exactly the index's: it takes the index's
own record of host-memory changes (``Client.take_events``, on with ``index_events``) and
reads the stream until every block that record names is held in the view if and only if
the index holds it. The stream carries those changes in order, so the wait ends when the
stream has delivered them all, and the view is then the one a router would have if the
stream were instant. The disk tier (``STORAGE``) is read as far as it has arrived: the
index's record covers host memory only, so a disk holding may show a batch late.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterable
from typing import Any

from tiercache.config import Config
from tiercache.tools.replay.events import CPU

SEQ_BYTES = 8
POLL_MS = 200  # between two looks at the index's record while the stream has not caught up
REPLAY_AFTER_POLLS = 5  # the stream silent this many polls while behind: ask for a replay
GIVE_UP_S = 120.0  # behind for this long: the stream is broken (a bug, not a result)
ENDPOINTS = re.compile(r"events: publishing on (\S+?)(?:, replay on (\S+?))?;")


class NodeStreamError(RuntimeError):
    """The node's stream did not catch up with the index (a bug, never a result)."""


def bound_endpoints(serve_output: str) -> tuple[str, str]:
    """The (events, replay) endpoints a ``tiercache serve`` logged it bound."""
    found = ENDPOINTS.search(serve_output)
    if found is None or not found.group(2):
        raise NodeStreamError("tiercache serve logged no events and replay endpoints:\n"
                              + serve_output[-2000:])
    return found.group(1), found.group(2)


def key_hash(key: bytes) -> int:
    """A vLLM engine's coordinator key (namespace digest, block hash, u32 KV group) as the
    stream publishes it with ``hash_format = "int"``: the block hash's last 8 bytes."""
    return int.from_bytes(key[-12:-4], "big")


class NodeStreamView:
    """See the module docstring. ``close()`` closes the sockets and the client."""

    def __init__(self, config: Config, endpoint: str, replay_endpoint: str):
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        from tiercache.link.client import Client

        self._zmq = zmq
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._context = zmq.Context()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, 0)  # the replay reads only at decisions: keep all
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self._dealer = self._context.socket(zmq.DEALER)
        self._dealer.setsockopt(zmq.LINGER, 0)
        self._dealer.connect(replay_endpoint)
        self._client = Client(config, name="replay-router")
        self.held: dict[str, set[int]] = {}
        self._truth: dict[int, bool] = {}  # host memory, per the index's record
        self._behind: set[int] = set()  # hashes whose view differs from the truth
        self._pending: dict[int, tuple[bytes, bytes]] = {}  # by sequence number
        self._next_seq = 0
        self._started = False
        self.num_events = 0
        self.num_batches = 0
        self.num_replays = 0

    def holds(self, medium: str, block_hash: Any) -> bool:
        return block_hash in self.held.get(medium, ())

    # ------------------------------------------------------------------ the wait
    def sync(self) -> None:
        """Until the view of host memory is the index's (see the module docstring)."""
        self._take_truth()
        self._read(block_ms=0)
        silent = 0
        began = time.monotonic()
        while self._behind:
            if self._read(block_ms=POLL_MS):
                silent = 0
            else:
                silent += 1
                self._take_truth()  # a tier thread may have changed host memory since
                if silent >= REPLAY_AFTER_POLLS:
                    self._ask_replay()
                    silent = 0
            if self._behind and time.monotonic() - began > GIVE_UP_S:
                raise NodeStreamError(
                    f"the node's stream did not catch up with the index in {GIVE_UP_S} s: "
                    f"{len(self._behind)} blocks differ, next sequence {self._next_seq}")

    def _take_truth(self) -> None:
        while True:
            events = self._client.take_events()
            for event in events:
                for key in event.keys:
                    h = key_hash(key)
                    self._truth[h] = not event.removed
                    self._check(h)
            if not events:
                return

    def _check(self, h: int) -> None:
        if (h in self.held.get(CPU, ())) == self._truth.get(h, False):
            self._behind.discard(h)
        else:
            self._behind.add(h)

    # ------------------------------------------------------------------ the sockets
    def _read(self, block_ms: int) -> bool:
        """Take what both sockets hold (waiting up to ``block_ms`` for the first message);
        apply every batch that is next in sequence. Whether anything came."""
        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._sub, zmq.POLLIN)
        poller.register(self._dealer, zmq.POLLIN)
        if not poller.poll(block_ms):
            return False
        while True:
            got = False
            while self._sub.poll(0):
                topic, seq, payload = self._sub.recv_multipart()
                self._arrived(int.from_bytes(seq, "big", signed=True), topic, payload)
                got = True
            while self._dealer.poll(0):
                frames = self._dealer.recv_multipart()
                _, topic, seq, payload = frames
                number = int.from_bytes(seq, "big", signed=True)
                if number >= 0:  # -1: the end of a replay
                    self._arrived(number, topic, payload)
                got = True
            if not got:
                return True

    def _arrived(self, seq: int, topic: bytes, payload: bytes) -> None:
        if not self._started:
            # a subscriber that joined late starts at what it sees, unless that is a gap
            # the replay buffer can fill (everything from the stream's first batch)
            self._started = True
            if seq > 0:
                self._ask_replay()
        if seq < self._next_seq:
            return  # a replayed batch already applied
        self._pending[seq] = (topic, payload)
        if seq > self._next_seq and len(self._pending) == 1:
            self._ask_replay()
        while self._next_seq in self._pending:
            _, data = self._pending.pop(self._next_seq)
            self._apply(self._decoder.decode(data).events)
            self._next_seq += 1
            self.num_batches += 1

    def _ask_replay(self) -> None:
        self._dealer.send_multipart([b"", self._next_seq.to_bytes(SEQ_BYTES, "big")])
        self.num_replays += 1

    def _apply(self, events: Iterable[Any]) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        for event in events:
            self.num_events += 1
            if isinstance(event, AllBlocksCleared):
                changed = self.held.get(CPU, set())
                self.held.clear()
            elif isinstance(event, (BlockStored, BlockRemoved)):
                medium = event.medium or CPU
                held = self.held.setdefault(medium, set())
                if isinstance(event, BlockStored):
                    held.update(event.block_hashes)
                else:
                    held.difference_update(event.block_hashes)
                changed = set(event.block_hashes) if medium == CPU else set()
            else:
                continue
            for h in changed:
                self._check(h)

    def close(self) -> None:
        self._client.close()
        self._sub.close(0)
        self._dealer.close(0)
        self._context.term()
