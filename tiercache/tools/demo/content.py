"""What a block holds in the demo: a deterministic function of (key, rank, tensor).

Page bytes of tensor t at rank r for key k are ``base_t XOR seed(k, r, t)``, word by
word (64-bit): ``base_t`` is a fixed random page per tensor and the seed a splitmix64
hash of the key's first 8 bytes mixed with rank and tensor. Two different seeds differ
in every word, so a block from another key, rank or tensor, a torn or a missing copy
all fail the check; generating and checking cost one XOR per word, on the device
that holds the caches.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)


def key_seeds(keys: Sequence[bytes]) -> np.ndarray:
    """One uint64 per key (its first 8 bytes: keys are hash digests)."""
    return np.array([int.from_bytes(k[:8], "little") for k in keys], dtype=np.uint64)


def _splitmix(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = z + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _MIX1
        z = (z ^ (z >> np.uint64(27))) * _MIX2
        return z ^ (z >> np.uint64(31))


def page_seeds(seeds: np.ndarray, rank: int, tensor: int) -> np.ndarray:
    """Per-page seeds of ``tensor`` at ``rank`` for key seeds ``seeds``."""
    with np.errstate(over="ignore"):
        salt = _splitmix(np.array([rank * 65536 + tensor], dtype=np.uint64))
    return _splitmix(seeds.astype(np.uint64) ^ salt)


class BlockContent:
    """Expected pages of one rank, for filling GPU blocks and checking loaded ones.

    A CPU block of tensor t is ``block_size_factor`` consecutive GPU blocks of
    ``page_bytes[t]``; GPU block ids arrive as a tensor, ``factor`` per CPU block. Pages
    are handled as 64-bit words when every page is a multiple of 8 bytes (one compare
    per word), else byte by byte.
    """

    def __init__(self, page_bytes: Sequence[int], block_size_factor: int, rank: int,
                 device: torch.device):
        self.rank = rank
        self.factor = block_size_factor
        self.page_bytes = tuple(page_bytes)
        self.device = device
        self._words = all(p % 8 == 0 for p in self.page_bytes)
        self._bases = []
        for t, page in enumerate(self.page_bytes):
            words = -(-page * block_size_factor // 8)
            rng = np.random.default_rng(t)
            base = rng.integers(-(1 << 63), (1 << 63) - 1, words, dtype=np.int64)
            self._bases.append(torch.from_numpy(base).to(device))

    def _expected_words(self, tensor: int, seeds: np.ndarray) -> torch.Tensor:
        s = torch.from_numpy(page_seeds(seeds, self.rank, tensor).view(np.int64)).to(self.device)
        return self._bases[tensor][None, :] ^ s[:, None]

    def expected(self, tensor: int, seeds: np.ndarray) -> torch.Tensor:
        """uint8 ``(len(seeds), factor * page_bytes[tensor])``: the CPU blocks' pages."""
        words = self._expected_words(tensor, seeds)
        return words.view(torch.uint8)[:, :self.factor * self.page_bytes[tensor]]

    def _view(self, cache: torch.Tensor) -> torch.Tensor:
        return cache.view(torch.int64) if self._words else cache

    def fill(self, caches: Sequence[torch.Tensor], gpu_ids: GpuIds, seeds: np.ndarray) -> None:
        """Write the pages of ``seeds``' blocks into GPU blocks ``gpu_ids`` (factor per key)."""
        for t, cache in enumerate(caches):
            pages = self._expected_words(t, seeds) if self._words else self.expected(t, seeds)
            gpu_ids.write(self._view(cache), pages.reshape(len(gpu_ids), -1))

    def clear(self, caches: Sequence[torch.Tensor], gpu_ids: GpuIds) -> None:
        for cache in caches:
            gpu_ids.write(cache, None)

    def count_mismatches(self, caches: Sequence[torch.Tensor], gpu_ids: GpuIds,
                         seeds: np.ndarray) -> int:
        """How many of the CPU blocks (one per seed) differ anywhere from what they should be."""
        bad = torch.zeros(len(seeds), dtype=torch.bool, device=self.device)
        for t, cache in enumerate(caches):
            got = gpu_ids.read(self._view(cache)).reshape(len(seeds), -1)
            want = self._expected_words(t, seeds) if self._words else self.expected(t, seeds)
            bad |= (got != want).any(dim=1)
        return int(bad.sum().item())


class GpuIds:
    """GPU block ids of one job: a slice when they are consecutive (no gather needed)."""

    def __init__(self, ids: np.ndarray, device: torch.device):
        self.ids = np.ascontiguousarray(ids, dtype=np.int64)
        consecutive = self.ids.size > 0 and bool(np.all(np.diff(self.ids) == 1))
        self._slice = slice(int(self.ids[0]), int(self.ids[-1]) + 1) if consecutive else None
        self._index = None if consecutive else torch.from_numpy(self.ids.copy()).to(device)

    def __len__(self) -> int:
        return int(self.ids.size)

    def read(self, cache: torch.Tensor) -> torch.Tensor:
        return cache[self._slice] if self._slice is not None else cache[self._index]

    def write(self, cache: torch.Tensor, rows: torch.Tensor | None) -> None:
        """Copy ``rows`` into the blocks (``None``: zero them)."""
        if self._index is None:  # consecutive: the slice
            target = cache[self._slice]
            if rows is None:
                target.zero_()
            else:
                target.copy_(rows)
        elif rows is None:
            cache.index_fill_(0, self._index, 0)
        else:
            cache.index_copy_(0, self._index, rows)
