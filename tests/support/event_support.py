"""Helpers of the event-stream tests: a vLLM subscriber process (``vllm_subscriber.py`` in
``.venv-vllm``, vLLM's own decoder), what it believes the node holds, and vLLM namespaces."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tiercache.vllm.namespace import GroupShape, Namespace

REPO = Path(__file__).resolve().parents[2]
SUBSCRIBER = Path(__file__).with_name("vllm_subscriber.py")
START_S = 300.0  # importing vLLM
# a bound on a wait for a condition, never a measured expectation
WAIT_S = float(os.environ.get("TIERCACHE_TEST_WAIT_S", "120"))


def vllm_python() -> str:
    """The interpreter of the vLLM 0.33 venv (``make venv-vllm``; or
    ``TIERCACHE_VLLM_PYTHON``)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        version("vllm")
        return sys.executable  # the tests run in the vLLM venv already
    except PackageNotFoundError:
        pass
    path = os.environ.get("TIERCACHE_VLLM_PYTHON") or str(REPO / ".venv-vllm" / "bin" / "python")
    if not os.path.exists(path):
        pytest.skip(f"no vLLM venv at {path} (make venv-vllm, or set TIERCACHE_VLLM_PYTHON)")
    return path


def namespace(model: str = "m", blocks_per_chunk: int = 1, tokens: int = 16,
              salt: str = "") -> Namespace:
    return Namespace(model=model, kv_dtype="bfloat16", kv_layout="", world_size=1, tp_size=1,
                     pp_size=1, pcp_size=1, dcp_size=1, tokens_per_hash=tokens,
                     blocks_per_chunk=blocks_per_chunk,
                     groups=(GroupShape(tokens, ("layers.0",), None),), salt=salt)


def vllm_key(ns: Namespace, block_hash: bytes, group: int = 0) -> bytes:
    """A wire key as the vLLM adapter builds it: digest + vLLM's OffloadKey."""
    return ns.digest + block_hash + group.to_bytes(4, "big")


def vllm_int_hash(block_hash: bytes) -> int:
    """vLLM's ``maybe_convert_block_hash`` (int form), written out independently."""
    value = 0
    for byte in block_hash[-8:]:
        value = value * 256 + byte
    return value


@dataclass
class Seen:
    """What a subscriber has read, and what it believes each (topic, medium) holds."""

    batches: list[dict[str, Any]] = field(default_factory=list)
    gaps: list[list[int]] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)

    def held(self) -> dict[tuple[str, str], set]:
        view: dict[tuple[str, str], set] = {}
        for batch in sorted(self.batches, key=lambda b: b["seq"]):
            for event in batch["events"]:
                if event["type"] == "AllBlocksCleared":
                    view.clear()
                    continue
                place = view.setdefault((batch["topic"], event["medium"]), set())
                for h in event["block_hashes"]:
                    (place.add if event["type"] == "BlockStored" else place.discard)(h)
        return {k: v for k, v in view.items() if v}

    @property
    def seqs(self) -> list[int]:
        return sorted(b["seq"] for b in self.batches)

    def events(self, kind: str) -> list[tuple[dict, dict]]:
        return [(b, e) for b in self.batches for e in b["events"] if e["type"] == kind]


class VllmSubscriber:
    """The subscriber process (see ``vllm_subscriber.py``); ``seen`` fills as lines come."""

    def __init__(self) -> None:
        self._pending = b""
        self.proc = subprocess.Popen([vllm_python(), str(SUBSCRIBER)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=str(REPO),
                                     env={k: v for k, v in os.environ.items()
                                          if k != "PYTHONPATH"})
        self.seen = Seen()
        self.conn = 0
        self.wait_for(lambda line: line.get("started"), START_S)

    def _line(self, timeout_s: float) -> dict[str, Any] | None:
        """The next line, read from the pipe unbuffered (a buffered reader would keep lines
        select() cannot see)."""
        while b"\n" not in self._pending:
            if not select.select([self.proc.stdout], [], [], timeout_s)[0]:
                return None
            chunk = os.read(self.proc.stdout.fileno(), 1 << 16)
            if not chunk:
                raise AssertionError(f"the subscriber exited with {self.proc.wait()}")
            self._pending += chunk
        text, _, self._pending = self._pending.partition(b"\n")
        line = json.loads(text)
        if line.get("conn", self.conn) != self.conn:
            return line  # a line of an earlier connection, printed before this one began
        if "seq" in line and "error" in line:
            self.seen.errors.append(line)
        elif "seq" in line:
            self.seen.batches.append(line)
        elif "gap" in line:
            self.seen.gaps.append(line["gap"])
        return line

    def wait_for(self, done: Callable[[dict[str, Any]], Any], wait_s: float = WAIT_S
                 ) -> dict[str, Any]:
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            line = self._line(deadline - time.monotonic())
            if line is not None and done(line):
                return line
        raise AssertionError(f"no such line from the subscriber within {wait_s} s")

    def until(self, condition: Callable[[Seen], bool]) -> Seen:
        """Read until ``condition(seen)`` holds. The wait ends when it holds or when the
        subscriber has said nothing for ``WAIT_S``: a loaded machine may take minutes to
        pass 200 batches through the subscriber's pipe, and a subscriber that still prints
        is still getting there (pytest-timeout is the backstop)."""
        deadline = time.monotonic() + WAIT_S
        while not condition(self.seen):
            if time.monotonic() > deadline:
                last = [(b.get("seq"), len(b.get("events", ()))) for b in self.seen.batches[-3:]]
                raise AssertionError(
                    f"subscriber condition not met; nothing new for {WAIT_S} s after "
                    f"{len(self.seen.batches)} batches, {len(self.seen.gaps)} gaps "
                    f"(last (seq, events): {last})")
            if self._line(0.2) is not None:
                deadline = time.monotonic() + WAIT_S
        return self.seen

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def connect(self, endpoint: str, replay: str = "-", topic: str = "",
                rcvhwm: int = 0) -> Seen:
        self.seen = Seen()
        self.conn += 1
        self.send(f"connect {endpoint} {replay or '-'} {topic or '-'} {rcvhwm}")
        self.wait_for(lambda line: line.get("ready"))
        return self.seen

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def ns_keys(ns: Namespace, first: int, n: int) -> list[bytes]:
    """Keys ``first .. first + n - 1`` under ``ns`` (their block hashes the indices)."""
    return [vllm_key(ns, i.to_bytes(32, "big")) for i in range(first, first + n)]


def store_keys(client, keys: list[bytes]) -> None:
    """Store ``keys`` through ``client`` (prepare, then complete what it may store)."""
    out = client.prepare_store(keys)
    assert out is not None
    client.complete_store(list(out.keys_to_store))


def topic_of(ns: Namespace) -> str:
    """The stream topic of ``ns``'s batches."""
    return f"{ns.model}@{ns.digest.hex()}"


def hashes_of(keys: list[bytes]) -> set[int]:
    """The int block hashes vLLM's events carry for these keys."""
    return {vllm_int_hash(k[8:-4]) for k in keys}


def free_port() -> int:
    """A TCP port free on loopback now (for a stream that must keep its port across a
    restart; the kernel may hand it out again meanwhile: rare, and the start then fails
    loudly)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stream_endpoints(coordinator) -> tuple[str, str]:
    """The (events, replay) endpoints a running ``tiercache serve`` says it bound."""
    import re

    found = re.search(r"events: publishing on (\S+?)(?:, replay on (\S+?))?;",
                      coordinator.output())
    assert found, coordinator.output()
    return found.group(1), found.group(2) or "-"
