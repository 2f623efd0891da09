"""A prefix-reuse workload: requests that share prompt prefixes, reused Zipf-like.

A request either starts a conversation — one of ``num_prefixes`` shared prefixes (a
system prompt, a document), drawn with probability proportional to
``1 / (i + 1) ** zipf_s`` — or, with probability ``continue_p``, is the next turn of
one of the last ``recent_requests`` requests (its whole context again). Either way a
suffix of fresh blocks follows. Block keys are chained hashes, as engines compute them
(a block's key covers every token before it), so a shared block has the same key in
every request that shares it, and the suffix blocks of one turn are the prefix of the
next. A request never exceeds ``max_request_blocks``. Deterministic for a seed.
"""

from __future__ import annotations

import hashlib
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from tiercache.errors import ConfigError

KEY_BYTES = 16


def chain_key(parent: bytes, label: bytes) -> bytes:
    """The key of the block after ``parent`` whose tokens are named by ``label``."""
    return hashlib.blake2b(parent + label, digest_size=KEY_BYTES).digest()


@dataclass(frozen=True)
class WorkloadSpec:
    num_prefixes: int = 32
    zipf_s: float = 1.1
    min_prefix_blocks: int = 4
    max_prefix_blocks: int = 24
    min_suffix_blocks: int = 1
    max_suffix_blocks: int = 8
    continue_p: float = 0.3
    recent_requests: int = 16
    max_request_blocks: int = 64
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_prefixes < 1:
            raise ConfigError(f"num_prefixes = {self.num_prefixes}: must be >= 1")
        if not self.zipf_s >= 0:
            raise ConfigError(f"zipf_s = {self.zipf_s}: must be >= 0")
        for low, high, what in ((self.min_prefix_blocks, self.max_prefix_blocks, "prefix"),
                                (self.min_suffix_blocks, self.max_suffix_blocks, "suffix")):
            if not 0 <= low <= high:
                raise ConfigError(f"{what} blocks {low}..{high}: need 0 <= min <= max")
        if self.max_suffix_blocks < 1:
            raise ConfigError(f"max_suffix_blocks = {self.max_suffix_blocks}: must be >= 1 "
                              "(every request brings a new block)")
        if self.max_request_blocks < self.max_prefix_blocks + self.max_suffix_blocks:
            raise ConfigError(f"max_request_blocks = {self.max_request_blocks}: must be >= "
                              f"max prefix + max suffix = "
                              f"{self.max_prefix_blocks + self.max_suffix_blocks}")
        if not 0 <= self.continue_p <= 1:
            raise ConfigError(f"continue_p = {self.continue_p}: allowed 0..1")
        if self.recent_requests < 1:
            raise ConfigError(f"recent_requests = {self.recent_requests}: must be >= 1")


@dataclass(frozen=True)
class Request:
    index: int
    prefix: int  # which shared prefix its conversation started from (0: most popular)
    keys: tuple[bytes, ...]  # the context's keys (prefix or earlier turn), then the suffix's
    num_context_blocks: int


class PrefixWorkload:
    """Generates ``Request``\\ s; see the module docstring."""

    def __init__(self, spec: WorkloadSpec):
        self.spec = spec
        self._rng = np.random.default_rng(spec.seed)
        weights = 1.0 / np.arange(1, spec.num_prefixes + 1) ** spec.zipf_s
        self._probabilities = weights / weights.sum()
        lengths = self._rng.integers(spec.min_prefix_blocks, spec.max_prefix_blocks + 1,
                                     spec.num_prefixes)
        root = spec.seed.to_bytes(8, "little", signed=True)
        self._prefixes = [self._chain(chain_key(root, b"prefix-%d" % p), int(n), b"p")
                          for p, n in enumerate(lengths)]
        self._next_index = 0
        self._recent: deque[Request] = deque(maxlen=spec.recent_requests)

    @staticmethod
    def _chain(first: bytes, count: int, tag: bytes) -> tuple[bytes, ...]:
        keys, key = [], first
        for i in range(count):
            key = chain_key(key, tag + b"%d" % i)
            keys.append(key)
        return tuple(keys)

    def next_request(self) -> Request:
        spec = self.spec
        index = self._next_index
        self._next_index += 1
        num_suffix = int(self._rng.integers(max(1, spec.min_suffix_blocks),
                                            spec.max_suffix_blocks + 1))
        earlier = None
        if self._recent and self._rng.random() < spec.continue_p:
            earlier = self._recent[int(self._rng.integers(len(self._recent)))]
            if len(earlier.keys) + num_suffix > spec.max_request_blocks:
                earlier = None  # the conversation outgrew the context: start a new one
        if earlier is not None:
            prefix, keys = earlier.prefix, earlier.keys
        else:
            prefix = int(self._rng.choice(spec.num_prefixes, p=self._probabilities))
            keys = self._prefixes[prefix]
        parent = keys[-1] if keys else chain_key(b"", b"root-%d" % prefix)
        suffix = self._chain(chain_key(parent, b"request-%d" % index), num_suffix, b"s")
        request = Request(index, prefix, keys + suffix, len(keys))
        self._recent.append(request)
        return request

    def requests(self, count: int | None) -> Iterator[Request]:
        """``count`` requests (``None``: without end)."""
        made = 0
        while count is None or made < count:
            yield self.next_request()
            made += 1
