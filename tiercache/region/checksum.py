"""Record checksums for the region's durable tables (the index ledger, the session table).

``record_checksums(words, salts)`` hashes each row of a ``(n, w)`` uint64 array together
with a per-row salt (the record's index in its table, so a record copied to another slot
does not check). Vectorised with numpy, no Python loop per record: the control path
checksums every record it rewrites.

Why this function: every step that mixes one word is a bijection of 64-bit values
(multiply by an odd constant, xor-shift), and the words are combined by addition after a
per-position multiplier. So a change confined to one word (any single bit flip, any
scribble within 8 bytes) always changes the sum: detection is certain, not probable. A
change spread over several words goes undetected with a chance of about 2**-64. It is not
a cryptographic MAC: the region is 0600, and what it guards against is damage, not an
adversary who can write the cache.
"""

from __future__ import annotations

import numpy as np

_M1 = np.uint64(0x9E3779B97F4A7C15)
_M2 = np.uint64(0xBF58476D1CE4E5B9)
_M3 = np.uint64(0x94D049BB133111EB)
_S1, _S2 = np.uint64(31), np.uint64(27)


def _mix(x: np.ndarray) -> np.ndarray:
    """A bijection of uint64 (splitmix64's finaliser); works in place on a fresh array."""
    x ^= x >> _S1
    x *= _M2
    x ^= x >> _S2
    x *= _M3
    x ^= x >> _S1
    return x


def record_checksums(words: np.ndarray, salts: np.ndarray) -> np.ndarray:
    """One uint64 checksum per row of ``words`` (``(n, w)`` uint64), salted by ``salts``
    (``n`` integers). Never 0, so an all-zero record (a fresh table) never checks."""
    n, w = words.shape
    with np.errstate(over="ignore"):
        position = (np.arange(1, w + 1, dtype=np.uint64) * _M1) | np.uint64(1)  # odd: bijective
        # A word that is zero adds _mix(0) = 0: columns zero in every row are skipped (a
        # 32-byte key leaves 28 of a ledger record's 39 words zero), the sum is the same.
        used = np.flatnonzero(words.any(axis=0))
        mixed = _mix(words[:, used] * position[used])
        total = mixed.sum(axis=1, dtype=np.uint64)
        total += _mix(np.asarray(salts, dtype=np.uint64) * _M1 + np.uint64(w))
        total = _mix(total)
    total[total == 0] = 1
    return total
