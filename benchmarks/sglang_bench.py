"""SGLang backend benchmark (issue 31): one command, results written to a directory.

    PYTHONPATH=.:tests/sglang:tests/sglang/stubs .venv-sglang/bin/python \
        benchmarks/sglang_bench.py --out DIR [--pages 64] [--page-size 64] [--reps 5]

Measured in one run, on SGLang 0.5.23's real host pool and controller call path (the
controller's ``page_set_func`` / ``page_get_func``, i.e. ``_page_set_zero_copy`` ->
``batch_set_v1`` for tiercache, ``_generic_page_set`` -> ``batch_set`` for SGLang's own
``file`` backend), a Llama-3-8B-like TP=1 rank (32 layers, 8 KV heads of 128, bf16):

* ``ceiling``: the same native copy pool (``HostCopyPool``, same threads) moving the same
  bytes as one contiguous piece between private buffers, and numpy's single-threaded copy;
  every set/get call is paired with a ceiling copy right before it and reported as the
  median of the pairs' ratios (the machine may be shared: both halves of a pair see it
  alike);
* ``tiercache set/get``: ``--pages`` pages per call (fresh keys per set; the same keys per
  get), against a real ``tiercache serve`` started here;
* ``file set/get``: SGLang's ``file`` backend writing to ``--file-dir`` (tmpfs by default,
  so both sides are host memory);
* ``exists``: ``batch_exists`` of 128 keys, and of 1,000 pages (8 calls, as SGLang batches
  them) while ``--backup-engines`` other engine processes back up continuously;
* ``call cost``: one-page ``batch_set_v1`` / ``batch_get_v1`` (the fixed host cost per call).

With ``--mooncake``: Mooncake Store's SGLang backend (SGLang's built-in ``mooncake``,
zero-copy v1) against a ``mooncake_master`` started here on loopback TCP.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "sglang"), str(ROOT / "tests" / "sglang" / "stubs"),
                str(ROOT / "tests" / "support")]

LAYERS, HEADS, HEAD_DIM = 32, 8, 128


class _Op:
    request_id = "bench"

    @staticmethod
    def is_terminated() -> bool:
        return False


def _controller(backend: str, extra: dict, pages: int, page_size: int):
    import torch
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0, tp_size=1,
                                        pp_rank=0, pp_size=1)
    tokens = pages * page_size
    device = MHATokenToKVPool(size=tokens, page_size=page_size, dtype=torch.bfloat16,
                              head_num=HEADS, head_dim=HEAD_DIM, layer_num=LAYERS, device="cpu",
                              enable_memory_saver=False)
    cls, info, kw = _mha_host_inputs(device)
    host = cls(info, 2.2, 0, page_size, "page_first_direct", pin_memory=False, **kw)
    allocator = PagedTokenToKVPoolAllocator(tokens, page_size, torch.bfloat16, "cpu", device,
                                            need_sort=False)
    controller = HiCacheController(allocator, host, page_size=page_size, tp_group=None,
                                   load_cache_event=threading.Event(), io_backend="direct",
                                   storage_backend=backend, storage_backend_extra_config=extra,
                                   model_name="llama-3-8b-like")
    return controller, host


def _hashes(seed: int, pages: int, page_size: int) -> list[str]:
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    rng = np.random.default_rng(seed)
    return get_storage_hash_str([int(t) for t in rng.integers(1, 30000, pages * page_size)],
                                None, page_size=page_size)


def _rate(nbytes: int, seconds: list[float]) -> dict:
    med = statistics.median(seconds)
    return {"median_s": med, "gbps": nbytes / med / 1e9, "runs_s": seconds}


def _same_pages(host, src, dst, page_size: int) -> bool:
    """Whether the loaded pages hold the stored bytes (checked once, untimed)."""
    import ctypes

    for p in range(len(src) // page_size):
        a, sizes = host.get_page_buffer_meta(src[p * page_size:(p + 1) * page_size])
        b, _ = host.get_page_buffer_meta(dst[p * page_size:(p + 1) * page_size])
        if any(ctypes.string_at(x, n) != ctypes.string_at(y, n) for x, y, n in zip(a, b, sizes)):
            return False
    return True


class _Ceiling:
    """The machine's multi-threaded memcpy ceiling, measured right before each measured call
    (the same native pool and threads, the same bytes as one piece between private
    buffers), so the two see the same machine: this VM's 2 cores are shared."""

    def __init__(self, nbytes: int, threads: int):
        from tiercache.transfer.host_copy import HostCopyPool

        self.nbytes = nbytes
        self.a = np.ones(nbytes, dtype=np.uint8)
        self.b = np.ones_like(self.a)  # touched: no first-touch faults in the timed copies
        self.pool = HostCopyPool(threads)
        self.pieces = (np.array([self.b.ctypes.data], dtype=np.uint64),
                       np.array([self.a.ctypes.data], dtype=np.uint64),
                       np.array([nbytes], dtype=np.uint64))
        self.seconds: list[float] = []

    def measure(self) -> float:
        start = time.perf_counter()
        self.pool.copy(*self.pieces)
        self.seconds.append(time.perf_counter() - start)
        return self.seconds[-1]


def _set_get(controller, host, pages: int, page_size: int, reps: int, seed: int,
             ceiling: _Ceiling) -> dict:
    """Each call paired with a ceiling copy just before it: ``x_ceiling`` is the median of
    the pairs' ratios (first pair of each kind is a warm-up, not counted)."""
    import torch

    src = host.alloc(pages * page_size)
    dst = host.alloc(pages * page_size)
    view = host.kv_buffer.view(-1).view(dtype=torch.uint8)
    view[: view.numel() // 2].random_(0, 255)
    nbytes = pages * 2 * LAYERS * page_size * HEADS * HEAD_DIM * 2
    sets, gets, set_x, get_x = [], [], [], []
    keys = None
    for r in range(reps + 1):
        keys = _hashes(seed + r, pages, page_size)
        top = ceiling.measure()
        start = time.perf_counter()
        ok = controller.page_set_func(keys, src)
        took = time.perf_counter() - start
        assert ok, "a benchmark backup failed"
        if r:
            sets.append(took)
            set_x.append(top / took * nbytes / ceiling.nbytes)
    for r in range(reps + 1):
        top = ceiling.measure()
        start = time.perf_counter()
        got = controller.page_get_func(_Op(), keys, dst)
        took = time.perf_counter() - start
        assert got == pages, f"a benchmark load got {got} of {pages} pages"
        if r:
            gets.append(took)
            get_x.append(top / took * nbytes / ceiling.nbytes)
    out = {"set": _rate(nbytes, sets), "get": _rate(nbytes, gets), "bytes_per_call": nbytes,
           "bytes_exact": _same_pages(host, src, dst, page_size)}
    out["set"]["x_ceiling"] = statistics.median(set_x)
    out["get"]["x_ceiling"] = statistics.median(get_x)
    out["set"]["x_ceiling_runs"], out["get"]["x_ceiling_runs"] = set_x, get_x
    return out


def _ceiling(nbytes: int, reps: int, threads: int, host=None, rows: int = 0) -> dict:
    """The pool over one contiguous piece: private buffers (the machine's ceiling), and,
    with ``host``/``rows``, the host pool's buffer to the region's rows and back (the same
    memory kinds as the backend's copies: tmpfs pages for the region)."""
    from tiercache.transfer.host_copy import HostCopyPool

    a = np.ones(nbytes, dtype=np.uint8)
    b = np.ones_like(a)  # touched: no first-touch faults in the timed copies
    one = np.array([nbytes], dtype=np.uint64)
    pairs = {"pool": (b.ctypes.data, a.ctypes.data)}
    if host is not None:
        pairs["pool_to_region"] = (rows, host.kv_buffer.data_ptr())
        pairs["region_to_pool"] = (host.kv_buffer.data_ptr(), rows)
    out: dict = {}
    with HostCopyPool(threads) as pool:
        for name, (dst, src) in pairs.items():
            runs = []
            for _ in range(reps + 1):  # the first warms up
                start = time.perf_counter()
                pool.copy(np.array([dst], dtype=np.uint64), np.array([src], dtype=np.uint64), one)
                runs.append(time.perf_counter() - start)
            out[name] = _rate(nbytes, runs[1:])
        numpy_s = []
        for _ in range(reps):
            start = time.perf_counter()
            np.copyto(b, a)
            numpy_s.append(time.perf_counter() - start)
        out["numpy_1_thread"] = _rate(nbytes, numpy_s)
        out["pool_threads"] = pool.num_threads + 1
    return out


def _overhead_us(backend, host, page_size: int, calls: int = 20) -> dict:
    """Host time per one-page call that is not the copy (the copy's own seconds come from
    the attachment's stats block): the control-plane round trips and Python around them."""
    from tiercache.specs import Direction

    stats = backend.region.transfer().attachment.stats
    one = host.alloc(page_size)
    out = {}
    for verb, direction in (("batch_set_v1", Direction.GPU_TO_CPU),
                            ("batch_get_v1", Direction.CPU_TO_GPU)):
        walls, busy = [], []
        for r in range(calls):
            keys = _hashes(9000 + r, 1, page_size)
            if verb == "batch_get_v1":
                backend.batch_set_v1(keys, one)
            before = stats.snapshot().directions[direction].busy_seconds_total
            t = time.perf_counter()
            getattr(backend, verb)(keys, one)
            walls.append(time.perf_counter() - t)
            busy.append(stats.snapshot().directions[direction].busy_seconds_total - before)
        out[verb + "_1_page"] = statistics.median(w - b for w, b in zip(walls, busy)) * 1e6
        out[verb + "_1_page_copy"] = statistics.median(busy) * 1e6
    host.free(one)
    return out


def _backup_engine(config_path: str, page_size: int, stop, seed: int) -> None:
    controller, host = _controller("dynamic", _extra(config_path), 16, page_size)
    src = host.alloc(8 * page_size)
    n = 0
    while not stop.is_set():
        controller.page_set_func(_hashes(seed * 100000 + n, 8, page_size), src)
        n += 1
    controller.detach_storage_backend()


def _extra(config_path: str) -> dict:
    return {"backend_name": "tiercache", "module_path": "tiercache.sglang",
            "class_name": "TierCacheHiCacheStorage", "interface_v1": 1,
            "tiercache_config": config_path}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory for results.json and results.md")
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--backup-engines", type=int, default=3)
    parser.add_argument("--file-dir", default="/dev/shm")
    parser.add_argument("--mooncake", action="store_true",
                        help="also Mooncake Store's SGLang backend, against a mooncake_master "
                             "started here on loopback TCP")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    from tiercache.config import Config, ExporterConfig, KVGeometry, RegionConfig
    from tiercache.service.process import CoordinatorProcess
    from tiercache.transfer.host_copy import default_threads

    page_bytes = 2 * LAYERS * args.page_size * HEADS * HEAD_DIM * 2
    work = Path(tempfile.mkdtemp(prefix="tiercache-sglang-bench-"))
    config = Config(name=f"sglang-bench-{os.getpid()}", world_size=1,
                    kv=KVGeometry(page_bytes=(page_bytes // 2,) * 2, block_tokens=args.page_size),
                    region=RegionConfig(capacity_bytes=None, num_blocks=args.pages * 3,
                                        prefault_threads=2, attachments_per_rank=8),
                    exporter=ExporterConfig(enabled=False), control_socket=str(work / "c.sock"),
                    index_max_session_share=1.0)
    results: dict = {"machine": {"cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0)),
                                 "platform": platform.platform(), "python": sys.version.split()[0]},
                     "args": vars(args), "page_bytes": page_bytes,
                     "copy_threads_besides_caller": default_threads()}
    with CoordinatorProcess(config, workdir=work / "coord") as coordinator:
        controller, host = _controller("dynamic", _extra(str(coordinator.config_path)),
                                       args.pages, args.page_size)
        backend = controller.storage_backend
        ceiling = _Ceiling(args.pages * page_bytes, default_threads())
        results["tiercache"] = _set_get(controller, host, args.pages, args.page_size, args.reps,
                                        1, ceiling)
        rows = int(backend.region.transfer().attachment.row_addresses(np.array([0]))[0])
        results["ceiling"] = _ceiling(args.pages * page_bytes, args.reps, default_threads(),
                                      host, rows)
        results["call_us"] = _overhead_us(backend, host, args.page_size)
        keys128 = _hashes(1, 128, args.page_size)
        exists_128 = []
        for _ in range(20):
            t = time.perf_counter()
            backend.batch_exists(keys128)
            exists_128.append(time.perf_counter() - t)
        results["call_us"]["batch_exists_128_keys"] = statistics.median(exists_128) * 1e6
        # batch_exists of 1,000 pages while other engines back up
        keys1000 = _hashes(2, 1000, args.page_size)
        ctx = mp.get_context("spawn")
        stop = ctx.Event()
        others = [ctx.Process(target=_backup_engine, args=(str(coordinator.config_path),
                                                           args.page_size, stop, i + 1))
                  for i in range(args.backup_engines)]
        quiet = []
        for _ in range(10):
            t = time.perf_counter()
            for i in range(0, 1000, 128):
                backend.batch_exists(keys1000[i:i + 128])
            quiet.append(time.perf_counter() - t)
        for p in others:
            p.start()
        time.sleep(20)  # let them import SGLang and start backing up
        busy = []
        for _ in range(10):
            t = time.perf_counter()
            for i in range(0, 1000, 128):
                backend.batch_exists(keys1000[i:i + 128])
            busy.append(time.perf_counter() - t)
        stop.set()
        for p in others:
            p.join(60)
        results["exists_1000_pages_us"] = {"alone": statistics.median(quiet) * 1e6,
                                           "while_backups": statistics.median(busy) * 1e6,
                                           "backup_engines": args.backup_engines}
        controller.detach_storage_backend()
    if args.mooncake:
        results["mooncake"] = _mooncake(args, work, ceiling)
    file_dir = Path(tempfile.mkdtemp(prefix="sglang-file-", dir=args.file_dir))
    os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(file_dir)
    try:
        controller, host = _controller("file", {}, args.pages, args.page_size)
        results["file"] = _set_get(controller, host, args.pages, args.page_size, args.reps, 50,
                                   ceiling)
        controller.detach_storage_backend()
    finally:
        for f in file_dir.iterdir():
            f.unlink()
        file_dir.rmdir()
    results["ceiling"]["paired"] = _rate(ceiling.nbytes, ceiling.seconds)
    ceiling.pool.close()
    (out / "results.json").write_text(json.dumps(results, indent=2))
    (out / "results.md").write_text(_markdown(results))
    print(_markdown(results))
    return 0


def _mooncake(args, work: Path, ceiling: _Ceiling) -> dict:
    """SGLang's built-in ``mooncake`` backend (zero-copy v1 too) over loopback TCP."""
    from mooncake_master import MooncakeMaster

    master = MooncakeMaster(work / "mooncake")
    try:
        # room for every set of the run (its keys are fresh each time; no eviction is timed)
        segment = (args.reps + 2) * args.pages * 2 * LAYERS * args.page_size * HEADS * HEAD_DIM * 2
        extra = {"master_server_address": master.address, "metadata_server": master.metadata_url,
                 "protocol": "tcp", "local_hostname": "127.0.0.1", "device_name": "",
                 "global_segment_size": segment, "check_server": False}
        controller, host = _controller("mooncake", extra, args.pages, args.page_size)
        try:
            return _set_get(controller, host, args.pages, args.page_size, args.reps, 80, ceiling)
        finally:
            controller.detach_storage_backend()
    finally:
        master.stop()


def _markdown(r: dict) -> str:
    c = r["ceiling"]
    top = c["pool"]["gbps"]
    lines = [f"machine: {r['machine']['cpus']} CPUs ({r['machine']['affinity']} usable), "
             f"{r['machine']['platform']}; {r['args']['pages']} pages of "
             f"{r['page_bytes'] / 2**20:.1f} MiB per call, median of {r['args']['reps']}",
             "", "| what | GB/s | x ceiling |", "|---|---|---|",
             f"| ceiling: native pool, {c['pool_threads']} threads, one piece, private memory | "
             f"{top:.2f} | 1.00 |",
             f"| the same, paired before each measured call (median) | "
             f"{c['paired']['gbps']:.2f} | {c['paired']['gbps'] / top:.2f} |"]
    for name, text in (("pool_to_region", "host pool -> region rows, one piece"),
                       ("region_to_pool", "region rows -> host pool, one piece"),
                       ("numpy_1_thread", "numpy copy, 1 thread, private memory")):
        if name in c:
            lines.append(f"| {text} | {c[name]['gbps']:.2f} | {c[name]['gbps'] / top:.2f} |")
    for name in ("tiercache", "mooncake", "file"):
        for op in ("set", "get") if name in r else ():
            x = r[name][op]
            runs = ", ".join(f"{v:.2f}" for v in x["x_ceiling_runs"])
            exact = "" if r[name]["bytes_exact"] else " **loaded bytes differ**"
            lines.append(f"| {name} batch_{op}{exact} | {x['gbps']:.2f} | {x['x_ceiling']:.2f} "
                         f"(pairs: {runs}) |")
    u, e = r["call_us"], r["exists_1000_pages_us"]
    lines += ["", "| host cost per call (not the copy) | µs |", "|---|---|",
              f"| batch_set_v1, 1 page (its copy: {u['batch_set_v1_1_page_copy']:.0f} µs) | "
              f"{u['batch_set_v1_1_page']:.0f} |",
              f"| batch_get_v1, 1 page (its copy: {u['batch_get_v1_1_page_copy']:.0f} µs) | "
              f"{u['batch_get_v1_1_page']:.0f} |",
              f"| batch_exists, 128 keys | {u['batch_exists_128_keys']:.0f} |",
              f"| batch_exists of 1,000 pages (8 calls), alone | {e['alone']:.0f} |",
              f"| ... while {e['backup_engines']} engines back up | {e['while_backups']:.0f} |", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
