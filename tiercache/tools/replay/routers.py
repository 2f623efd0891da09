"""Routers: which engine a new request goes to.

``Router.pick(request, engines)`` answers an engine index; it may read what the engines
report (their unfinished requests; for ``prefix``, their KV events) but never their
internals. Ties go to the engine with fewer unfinished requests, then the lowest index.

* ``round_robin``: engines in turn.
* ``least_loaded``: fewest unfinished requests (queued, loading or running).
* ``prefix``: llm-d's way, a weighted sum of two scorers, the highest total wins. The
  prefix scorer: the longest prefix of the request's blocks an engine is known to hold,
  each block weighted by where it is (``MEDIUM_WEIGHTS``: GPU 1.0, CPU 0.8, as llm-d's
  precise-prefix-cache scorer weighs device above host hits; the disk tier, STORAGE, 0.5,
  our choice), as a fraction of the request's blocks. The load scorer: 1 for the least
  loaded engine, less ``1 / LOAD_SLACK`` for each unfinished request more, down to 0.
  Weighted ``PREFIX_WEIGHT`` : ``LOAD_WEIGHT`` (our choice, prefix first): a request whose
  blocks one engine holds on its GPU goes there however busy it is (3 against at most 2),
  unless other engines can load most of them from host memory too. A load scorer
  normalized between the least and the most loaded engine (llm-d's queue scorer) made a
  one-request difference outweigh a GPU-held conversation: on the chat trace it moved
  conversations and computed 7 % more prefill tokens without offloading or with vLLM's, 26
  % more with tiercache (docs/benchmarks.md). What an engine is known to hold: its own KV
  events (vLLM's GPU prefix cache, and its CPU tier with vLLM's offloading) and, in the
  tiercache arm, the node's stream (``nodestream.NodeStreamView``: a block in the node
  cache is held for every engine). The node's view matters through the weights: a block
  every engine can load from host memory leaves the GPU holder an advantage of 1.0 - 0.8 a
  block instead of 1.0, so a GPU holder a few requests busier than another engine loses
  the request (with the whole prompt node-held: 3 x 0.2 against 2 / 8 a request, past 2.4
  requests).
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Protocol

from tiercache.errors import ConfigError
from tiercache.tools.replay.engine import ReplayEngine
from tiercache.tools.replay.events import CPU, GPU, STORAGE, EventRecorder
from tiercache.tools.replay.trace import TraceRequest

MEDIUM_WEIGHTS = {GPU: 1.0, CPU: 0.8, STORAGE: 0.5}
PREFIX_WEIGHT = 3.0
LOAD_WEIGHT = 2.0
LOAD_SLACK = 8  # unfinished requests more than the least loaded that cost all of LOAD_WEIGHT


class HoldingsView(Protocol):
    """What a router may know of what some store holds (an engine's events, the node's)."""

    def holds(self, medium: str, block_hash: Any) -> bool: ...


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
    """``recorders[i]``: engine i's events (``events.EventRecorder``); ``node``: what the
    node cache holds for every engine (the tiercache arm's ``NodeStreamView``), synced
    before each decision (``sync()``)."""

    def __init__(self, recorders: Sequence[EventRecorder], block_tokens: int,
                 node: Any = None):
        self.recorders = recorders
        self.block_tokens = block_tokens
        self.node = node
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

    def score(self, views: Sequence[HoldingsView], hashes: Sequence[Any]) -> float:
        """The weighted leading run of ``hashes`` that ``views`` together hold."""
        total = 0.0
        for block_hash in hashes:
            weight = max((w for medium, w in MEDIUM_WEIGHTS.items()
                          if any(v.holds(medium, block_hash) for v in views)), default=0.0)
            if weight == 0.0:
                break
            total += weight
        return total

    def pick(self, request: TraceRequest, engines: Sequence[ReplayEngine]) -> int:
        if self.node is not None:
            self.node.sync()
        hashes = self.block_hashes(request)
        loads = [e.num_unfinished for e in engines]
        low = min(loads)
        totals = []
        for i in range(len(engines)):
            views = [self.recorders[i]] + ([self.node] if self.node is not None else [])
            prefix = self.score(views, hashes) / len(hashes) if hashes else 0.0
            load = max(0.0, 1.0 - (loads[i] - low) / LOAD_SLACK)
            totals.append((PREFIX_WEIGHT * prefix + LOAD_WEIGHT * load, prefix))
        best = max(t for t, _ in totals)
        chosen = _least(engines, [i for i, (t, _) in enumerate(totals) if t == best])
        if totals[chosen][1] > 0.0:
            self.routed_by_prefix += 1
        return chosen


def make_router(kind: RouterKind, recorders: Sequence[EventRecorder], block_tokens: int,
                node: Any = None) -> Router:
    if kind is RouterKind.ROUND_ROBIN:
        return RoundRobin()
    if kind is RouterKind.LEAST_LOADED:
        return LeastLoaded()
    return PrefixAware(recorders, block_tokens, node)
