"""Routers: which engine a new request goes to.

``Router.pick(request, engines)`` answers an engine index; it may read what the engines
report (their unfinished requests; for ``prefix``, their KV events) but never their
internals. Ties go to the engine with fewer unfinished requests, then the lowest index.

* ``round_robin``: engines in turn.
* ``least_loaded``: fewest unfinished requests (queued, loading or running).
* ``prefix``: the longest prefix of the request's blocks that an engine's events say it
  holds, each block weighted by where it is (``MEDIUM_WEIGHTS``: GPU 1.0, CPU 0.8, as
  llm-d's precise-prefix-cache scorer weighs device above host hits), among engines whose
  load is within ``LOAD_SLACK`` requests of the least loaded (a prefix scorer alone sends a
  shared system prompt's whole traffic to one engine; llm-d pairs it with a load scorer).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from tiercache.errors import ConfigError
from tiercache.tools.replay.engine import ReplayEngine
from tiercache.tools.replay.events import CPU, GPU, EventRecorder
from tiercache.tools.replay.trace import TraceRequest

MEDIUM_WEIGHTS = {GPU: 1.0, CPU: 0.8}
LOAD_SLACK = 8


class RouterKind(enum.Enum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOADED = "least_loaded"
    PREFIX = "prefix"

    @classmethod
    def parse(cls, name: str) -> RouterKind:
        try:
            return cls(name)
        except ValueError:
            raise ConfigError(f"--router {name!r}: allowed "
                              f"{', '.join(k.value for k in cls)}") from None


class Router(ABC):
    """See the module docstring."""

    @abstractmethod
    def pick(self, request: TraceRequest, engines: Sequence[ReplayEngine]) -> int:
        """The index of the engine that gets ``request`` (never raises for a valid one)."""


def _least(engines: Sequence[ReplayEngine], among: Sequence[int] | None = None) -> int:
    candidates = range(len(engines)) if among is None else among
    return min(candidates, key=lambda i: (engines[i].num_unfinished, i))


class RoundRobin(Router):
    def __init__(self) -> None:
        self._next = 0

    def pick(self, request: TraceRequest, engines: Sequence[ReplayEngine]) -> int:
        index = self._next % len(engines)
        self._next += 1
        return index


class LeastLoaded(Router):
    def pick(self, request: TraceRequest, engines: Sequence[ReplayEngine]) -> int:
        return _least(engines)


class PrefixAware(Router):
    """``recorders[i]``: engine i's events (``events.EventRecorder``)."""

    def __init__(self, recorders: Sequence[EventRecorder], block_tokens: int):
        self.recorders = recorders
        self.block_tokens = block_tokens
        self.routed_by_prefix = 0

    def block_hashes(self, request: TraceRequest) -> list[Any]:
        """The request's block hashes as the engines' events carry them (vLLM's own
        hasher: sha256 chained over full blocks)."""
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, maybe_convert_block_hash
        from vllm.v1.request import Request
        from vllm import SamplingParams

        probe = Request(request_id="router-probe", prompt_token_ids=list(request.prompt_token_ids),
                        sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                        block_hasher=get_request_block_hasher(self.block_tokens, sha256))
        return [maybe_convert_block_hash(h) for h in probe.block_hashes]

    def score(self, recorder: EventRecorder, hashes: Sequence[Any]) -> float:
        total = 0.0
        for block_hash in hashes:
            weight = max((w for medium, w in MEDIUM_WEIGHTS.items()
                          if recorder.holds(medium, block_hash)), default=0.0)
            if weight == 0.0:
                break
            total += weight
        return total

    def pick(self, request: TraceRequest, engines: Sequence[ReplayEngine]) -> int:
        floor = min(e.num_unfinished for e in engines)
        allowed = [i for i, e in enumerate(engines) if e.num_unfinished <= floor + LOAD_SLACK]
        hashes = self.block_hashes(request)
        scores = {i: self.score(self.recorders[i], hashes) for i in allowed}
        best = max(scores.values())
        if best == 0.0:
            return _least(engines, allowed)
        self.routed_by_prefix += 1
        return _least(engines, [i for i in allowed if scores[i] == best])


def make_router(kind: RouterKind, recorders: Sequence[EventRecorder], block_tokens: int
                ) -> Router:
    if kind is RouterKind.ROUND_ROBIN:
        return RoundRobin()
    if kind is RouterKind.LEAST_LOADED:
        return LeastLoaded()
    return PrefixAware(recorders, block_tokens)
