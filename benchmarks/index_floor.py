"""The floor of the language under the index (issue 41, item 3): what a CPython
``dict[bytes, int]`` of N 32-byte keys costs before tiercache adds anything.

For each N: the anonymous memory of the keys, their ints and the dict (``RssAnon`` grown,
per key, with ``sys.getsizeof`` of each part and pymalloc's 16-byte rounding); the time to
build it the way a recovery must (cut N keys from one blob of records, insert each); and
one 64-key run of fresh key objects looked up as ``takewhile(map(dict.get))`` (the index's
own lookup), best of 5 over 2,000 random runs, at 4,096 keys and at N.

    PYTHONPATH=. .venv/bin/python benchmarks/index_floor.py 100000 500000 2000000
"""

from __future__ import annotations

import gc
import operator
import os
import random
import struct
import sys
import time
from itertools import repeat, takewhile

KEY_BYTES = 32
_first = operator.itemgetter(0)
_HIT = (0).__le__


def rss_anon() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("RssAnon:"))


def cut(blob: bytes) -> list[bytes]:
    return list(map(_first, struct.iter_unpack(f"{KEY_BYTES}s", blob)))


def probe_us(index: dict[bytes, int], blob: bytes, n: int) -> float:
    rng = random.Random(0)
    starts = [rng.randrange(n // 64) * 64 * KEY_BYTES for _ in range(2000)]
    best = float("inf")
    for _ in range(5):
        runs = [cut(blob[s:s + 64 * KEY_BYTES]) for s in starts]  # new objects, as decoded
        t0 = time.perf_counter()
        for run in runs:
            len(list(takewhile(_HIT, map(index.get, run, repeat(-1)))))
        best = min(best, (time.perf_counter() - t0) / len(runs))
    return best * 1e6


def main(sizes: list[int]) -> None:
    print(f"load {os.getloadavg()}; Python {sys.version.split()[0]}")
    small = os.urandom(4096 * KEY_BYTES)
    base_us = probe_us(dict(zip(cut(small), range(4096))), small, 4096)
    print(f"64 fresh keys looked up in a dict of 4,096: {base_us:.1f} us")
    for n in sizes:
        blob = os.urandom(n * KEY_BYTES)
        gc.collect()
        before = rss_anon()
        t0 = time.perf_counter()
        index = dict(zip(cut(blob), range(n)))
        build_s = time.perf_counter() - t0
        grown = (rss_anon() - before) / n
        parts = {"dict": sys.getsizeof(index) / n,
                 "key (bytes of 32)": sys.getsizeof(next(iter(index))),
                 "int value": sys.getsizeof(n - 1)}
        print(f"{n:>9,} keys: RssAnon +{grown:.0f} B a key ("
              + ", ".join(f"{k} {v:.1f}" for k, v in parts.items())
              + f"); built in {build_s:.2f} s ({build_s / n * 1e6:.2f} us a key); "
              f"64 fresh keys looked up in {probe_us(index, blob, n):.1f} us")
        del index, blob
        gc.collect()


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [100_000, 500_000, 2_000_000])
