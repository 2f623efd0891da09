"""tiercache's side of SGLang's ``batch_set_v1`` / ``batch_get_v1``, without SGLang: the
fenced host-to-host copy between an engine's host pages and the region, through a real
``tiercache serve``, against the same machine's multi-threaded memcpy ceiling measured in
the same run (issue 31). It runs where SGLang is not installed (the GPU machine's 16 cores:
the path is host to host), so the copy path's ratio to the ceiling can be read on a machine
with more cores than the development VM.

    PYTHONPATH=. python3 benchmarks/host_copy_bench.py --out DIR [--pages 64] [--reps 7]

Per call, as the backend does it: ``prepare_store`` of ``--pages`` fresh keys, the fenced
store copy (``HostTransfer.store``: the engine pages' K and V blobs into the reserved rows),
``complete_store``; a load is ``lease`` of those keys, the fenced load copy (checked again
after it), ``release``. Pages are a Llama-3-8B-like rank's (32 layers, 8 KV heads of 128,
bf16, 64 tokens a page: a 4 MiB K blob and a 4 MiB V blob). The ceiling is the same native
copy pool (same threads) moving the same bytes as one contiguous piece between two private
buffers, paired with each call (run right before it); also numpy's one-thread copy. Figures
are medians of the pairs; the transparent-huge-page settings are recorded beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT)]

LAYERS, HEADS, HEAD_DIM, DTYPE_BYTES = 32, 8, 128, 2


def _thp() -> dict[str, str]:
    out = {}
    for name in ("enabled", "shmem_enabled"):
        try:
            out[name] = Path(f"/sys/kernel/mm/transparent_hugepage/{name}").read_text().strip()
        except OSError as e:
            out[name] = f"unreadable ({e.strerror})"
    return out


def _buffer(num_bytes: int) -> np.ndarray:
    buf = np.empty(num_bytes, np.uint8)
    buf[::4096] = 1  # touched: page faults are not timed
    return buf


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for results.json / .txt")
    parser.add_argument("--pages", type=int, default=64, help="pages per call (default 64)")
    parser.add_argument("--page-tokens", type=int, default=64, help="tokens per page")
    parser.add_argument("--reps", type=int, default=7, help="timed calls per direction")
    parser.add_argument("--threads", type=int, default=None,
                        help="copy threads (default: the pool's own default)")
    args = parser.parse_args()

    from tiercache.config import Config, ExporterConfig, KVGeometry, RegionConfig
    from tiercache.link.client import Client
    from tiercache.service.process import CoordinatorProcess
    from tiercache.transfer.host_copy import HostCopyPool
    from tiercache.transfer.host_pages import PageMap
    from tiercache.transfer.host_transfer import HostAttachment, HostTransfer

    blob = LAYERS * args.page_tokens * HEADS * HEAD_DIM * DTYPE_BYTES  # K or V of a page
    pages = args.pages
    call_bytes = 2 * blob * pages
    work = Path(tempfile.mkdtemp(prefix="tiercache-hostbench-"))
    name = f"hostbench-{os.getpid()}"
    config = Config(name=name, world_size=1, kv=KVGeometry(page_bytes=(blob, blob)),
                    region=RegionConfig(capacity_bytes=None, num_blocks=4 * pages,
                                        prefault_threads=4, check_host_memory=True),
                    exporter=ExporterConfig(enabled=False),
                    control_socket=str(work / "ctl.sock"), index_max_session_share=1.0)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    results: dict = {"machine": {"cpus": os.cpu_count(), "platform": platform.platform(),
                                 "thp": _thp()},
                     "pages_per_call": pages, "page_bytes": 2 * blob, "call_bytes": call_bytes}
    with CoordinatorProcess(config, work / "c"):
        attachment = HostAttachment.attach(name, 0)
        pool_threads = args.threads
        transfer = HostTransfer(attachment, PageMap.onto((blob, blob), attachment.layout),
                                copy_threads=pool_threads)
        ceiling_pool = HostCopyPool(pool_threads)
        src, dst = _buffer(call_bytes), _buffer(call_bytes)
        engine = _buffer(call_bytes)  # the engine's host pages: K, V of each page in a row
        engine[:] = np.arange(call_bytes, dtype=np.uint64).astype(np.uint8)
        blob_addrs = (np.uint64(engine.ctypes.data) + np.arange(2 * pages, dtype=np.uint64)
                      * np.uint64(blob)).reshape(pages, 2)  # (page, K or V)
        one = np.array([call_bytes], np.uint64)

        def ceiling() -> float:
            start = time.perf_counter()
            ceiling_pool.copy(np.array([dst.ctypes.data], np.uint64),
                              np.array([src.ctypes.data], np.uint64), one)
            return call_bytes / (time.perf_counter() - start) / 1e9

        start = time.perf_counter()
        np.copyto(dst, src)
        numpy_gbs = call_bytes / (time.perf_counter() - start) / 1e9
        pairs: dict[str, list[tuple[float, float]]] = {"set": [], "get": []}
        host_ms: dict[str, list[float]] = {"set": [], "get": []}
        with Client(config) as client:
            for rep in range(args.reps + 1):  # the first round warms up, untimed
                keys = [b"hostbench-%d-%d" % (rep, i) for i in range(pages)]
                ceil = ceiling()
                t0 = time.perf_counter()
                out = client.prepare_store(keys)
                t1 = time.perf_counter()
                stored = transfer.store(out.store_spec, blob_addrs)
                t2 = time.perf_counter()
                client.complete_store(keys)
                t3 = time.perf_counter()
                assert stored.ok, stored
                if rep:
                    pairs["set"].append((call_bytes / (t3 - t0) / 1e9, ceil))
                    host_ms["set"].append(1e3 * ((t1 - t0) + (t3 - t2)))
                engine_copy = engine.copy()
                engine[:] = 0
                ceil = ceiling()
                t0 = time.perf_counter()
                lease = client.lease(keys)
                t1 = time.perf_counter()
                loaded = transfer.load(lease.spec, blob_addrs)
                t2 = time.perf_counter()
                client.release(keys)
                t3 = time.perf_counter()
                assert lease.num_hit == pages and loaded.ok, (lease, loaded)
                assert np.array_equal(engine, engine_copy), "a load did not bring the bytes back"
                if rep:
                    pairs["get"].append((call_bytes / (t3 - t0) / 1e9, ceil))
                    host_ms["get"].append(1e3 * ((t1 - t0) + (t3 - t2)))
        transfer.close()
        attachment.close()
        ceiling_pool.close()
    lines = [f"machine: {results['machine']}",
             f"{pages} pages of {2 * blob >> 20} MiB per call ({call_bytes >> 20} MiB); "
             f"numpy one-thread copy {numpy_gbs:.1f} GB/s; copy threads: "
             f"{'default' if args.threads is None else args.threads}",
             "direction   GB/s (median)   ceiling GB/s (paired)   ratio (median of pairs)   "
             "control-plane ms per call"]
    for what in ("set", "get"):
        rates = [r for r, _ in pairs[what]]
        ceils = [c for _, c in pairs[what]]
        ratio = statistics.median(r / c for r, c in pairs[what])
        results[what] = {"gbs": statistics.median(rates), "ceiling_gbs": statistics.median(ceils),
                         "ratio": ratio, "control_ms": statistics.median(host_ms[what]),
                         "pairs": pairs[what]}
        lines.append(f"{what:9s}   {statistics.median(rates):12.1f}   "
                     f"{statistics.median(ceils):21.1f}   {ratio:23.2f}   "
                     f"{statistics.median(host_ms[what]):25.2f}")
    results["numpy_one_thread_gbs"] = numpy_gbs
    (out_dir / "host_copy_bench.json").write_text(json.dumps(results, indent=1))
    (out_dir / "host_copy_bench.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
