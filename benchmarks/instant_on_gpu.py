"""Instant on at about 75 % of the host's RAM, on a GPU machine (issue 41, item 1).

One run, in this order, every figure beside the same run's ceiling:

1. **Ceiling**: one large pinned copy each way (``tiercache.tools.bench.rig.probe_rig``).
2. **A plain process**: a /dev/shm file of the same bytes, ``posix_fallocate``\\ d, pre-
   faulted with the same threads (``hostmem.prefault``) and registered with
   ``cuMemHostRegister`` in the same 256 MiB chunks (``HostPinner``), each step timed;
   then unregistered and removed.
3. **tiercache**: a real ``python -m tiercache serve`` child over a region of those bytes
   (one rank, 64 tensors of 32 KiB pages: a Llama-3-8B rank), timed from just before
   ``Popen`` to: its control socket answering; ``attach`` returning in this process (a
   worker over GPU caches); the first block stored and loaded back through the index and
   the worker, byte-exact; the whole slice reserved (header COMPLETE); the whole slice
   pinned (the worker's ``SlicePreparer`` done). While the slice is pinned in the
   background, 256-block stores and loads through the index run back to back: their
   engine-view rate (wall clock, submit to result) against the ceiling, and how many went
   the pinned and the unpinned path. Then the same transfers once everything is pinned.
   ``--idle``: no transfers while it is pinned (the preparation's own rate, the baseline
   of what the transfers cost it).

    PYTHONPATH=. python3 benchmarks/instant_on_gpu.py --fraction 0.75 --json $OUT/instant_on.json

Results: docs/benchmarks.md, "Instant on (issue 41, item 1)", GPU section.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time

import torch

GIB = 1 << 30
PAGE = 32 << 10
TENSORS = 64
TRANSFER_BLOCKS = 256
GPU_BLOCKS = 2 * TRANSFER_BLOCKS
POLL_S = 0.005
IDLE = False  # --idle: no transfers while the slice is prepared
DEVICE = "cuda"  # --smoke-cpu: host caches, nothing pinned (checks the script, no figure)
TOML = """[instance]
name = "{name}"
world_size = 1
[region]
capacity = "{gib}GiB"
pinning = "{pinning}"
check_host_memory = false
[kv]
page_bytes = {page}
num_tensors = {tensors}
[control]
socket = "{socket}"
[exporter]
enabled = false
"""


def say(line: str) -> None:
    print(line, flush=True)


def mem_total() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no MemTotal in /proc/meminfo")


def ceiling() -> dict[str, float]:
    from tiercache.tools.bench.rig import probe_rig

    rig, gbps = probe_rig(5)
    del rig
    torch.cuda.empty_cache()
    return gbps


def plain_process(num_bytes: int, threads: int) -> dict[str, float]:
    """fallocate, pre-fault and register ``num_bytes`` the way a plain process would."""
    from tiercache.device.pinning import HostPinner
    from tiercache.region.hostmem import prefault
    from tiercache.region.preparation import PREPARE_CHUNK_BYTES
    import numpy as np

    path = f"/dev/shm/instant-on-plain-{os.getpid()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    out: dict[str, float] = {}
    try:
        t = time.perf_counter()
        os.posix_fallocate(fd, 0, num_bytes)
        out["fallocate_s"] = time.perf_counter() - t
        m = mmap.mmap(fd, num_bytes)
        view = np.frombuffer(m, dtype=np.uint8)
        import ctypes
        address = ctypes.addressof(ctypes.c_char.from_buffer(m))
        step = -(-num_bytes // threads)
        step += -step % 4096
        ranges = [(o, min(step, num_bytes - o)) for o in range(0, num_bytes, step)]
        out["prefault_s"] = prefault(address, view, ranges, threads)
        pinner = HostPinner(0)
        chunks = [(address + o, min(PREPARE_CHUNK_BYTES, num_bytes - o))
                  for o in range(0, num_bytes, PREPARE_CHUNK_BYTES)]
        out["register_s"] = pinner.pin(chunks)
        out["unregister_s"] = pinner.unpin()
        del view
        m.close()
    finally:
        os.close(fd)
        os.unlink(path)
    out["total_s"] = out["fallocate_s"] + out["prefault_s"] + out["register_s"]
    return out


def wait_answers(socket_path: str, proc: subprocess.Popen, t0: float) -> float:
    from tiercache.link.client import Client

    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"serve exited with {proc.returncode} before it answered")
        try:
            with Client(socket_path, heartbeat=False) as c:
                c.stats()
            return time.perf_counter() - t0
        except Exception:
            time.sleep(POLL_S)


class Engine:
    """One worker over GPU caches and a client of the index: 256-block stores and loads."""

    def __init__(self, config, client, caches):
        from tiercache.transfer.worker import attach

        self.caches = caches
        t = time.perf_counter()
        self.worker = attach(config, 0, self.caches)
        self.attach_s = time.perf_counter() - t
        self.client, self.job, self.key, self.failed = client, 0, 0, 0

    def _run(self, store: bool, gpu_blocks, spec) -> float:
        from tiercache.specs import GPULoadStoreSpec

        self.job += 1
        gpu = GPULoadStoreSpec(gpu_blocks)
        t = time.perf_counter()
        if store:
            self.worker.submit_store(self.job, gpu, spec)
        else:
            self.worker.submit_load(self.job, spec, gpu)
        self.worker.wait([self.job])
        elapsed = time.perf_counter() - t
        results = self.worker.get_finished()
        if not results or not all(r.success for r in results):
            self.failed += 1  # counted and reported, never taken for a result
            return float("nan")
        return elapsed

    def round_trip(self, n: int) -> tuple[float, float, bool]:
        """Store n new blocks and load them back into the other half; (store s, load s,
        exact)."""
        keys = [b"k%012d" % (self.key + i) for i in range(n)]
        self.key += n
        out = self.client.prepare_store(keys)
        t_store = self._run(True, list(range(n)), out.store_spec)
        self.client.complete_store(keys)
        spec = self.client.prepare_load(keys)
        t_load = self._run(False, list(range(TRANSFER_BLOCKS, TRANSFER_BLOCKS + n)), spec)
        self.client.complete_load(keys)
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        exact = all(torch.equal(c[:n], c[TRANSFER_BLOCKS:TRANSFER_BLOCKS + n])
                    for c in self.caches[:4] + self.caches[-4:])
        return t_store, t_load, exact

    def routed(self) -> dict[str, dict[str, int]]:
        from tiercache.specs import Direction

        out = {}
        for d in Direction:
            path = self.worker.handlers.handler(d).path
            out[d.label] = dict(getattr(path, "routed", {}))
        return out


def tiercache_run(num_bytes: int, ceiling_gbps: dict[str, float]) -> dict:
    from tiercache.config.toml import load_config
    from tiercache.link.client import Client
    from tiercache.region.header import Reservation

    work = tempfile.mkdtemp(prefix="instant-on-")
    name = f"instant-on-{os.getpid()}"
    socket_path = os.path.join(work, "control.sock")
    cfg_path = os.path.join(work, "node.toml")
    with open(cfg_path, "w") as f:
        f.write(TOML.format(name=name, gib=num_bytes // GIB, page=PAGE, tensors=TENSORS,
                            socket=socket_path, pinning="required" if DEVICE == "cuda"
                            else "allow_unpinned"))
    config = load_config(cfg_path)
    out: dict = {"threads": config.region.prefault_threads}
    caches = [torch.randint(0, 256, (GPU_BLOCKS, PAGE), dtype=torch.uint8, device=DEVICE)
              for _ in range(TENSORS)]  # the engine's KV caches exist before it attaches
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "tiercache", "serve", "--config", cfg_path],
                            stdout=open(os.path.join(work, "serve.log"), "w"),
                            stderr=subprocess.STDOUT)
    try:
        out["answers_s"] = wait_answers(socket_path, proc, t0)
        client = Client(socket_path)
        engine = Engine(config, client, caches)
        out["attached_s"] = time.perf_counter() - t0
        out["attach_call_s"] = engine.attach_s
        st, ld, exact = engine.round_trip(1)
        out["first_block_s"] = time.perf_counter() - t0
        out["first_block_exact"] = exact
        preparer, region = engine.worker.preparer, engine.worker.region
        during: list[tuple[float, float, bool]] = []
        reserved_s = None
        n_bytes = TRANSFER_BLOCKS * TENSORS * PAGE
        while not preparer.complete:
            if IDLE:  # --idle: nothing but the preparation runs (the baseline of its rate)
                time.sleep(POLL_S)
            else:
                during.append(engine.round_trip(TRANSFER_BLOCKS))
            if reserved_s is None and region.info().reservation == Reservation.COMPLETE:
                reserved_s = time.perf_counter() - t0
        assert preparer.wait(600)
        out["pinned_s"] = time.perf_counter() - t0
        if reserved_s is None:
            while region.info().reservation != Reservation.COMPLETE:
                time.sleep(POLL_S)
            reserved_s = time.perf_counter() - t0
        out["reserved_s"] = reserved_s
        snap = engine.worker.stats.snapshot()
        out["pin_state"], out["pinned_bytes"] = snap.pin_state.label, snap.pinned_bytes
        out["prefault_s"], out["register_s"] = preparer.prefault_s, preparer.pin_s
        out["routed_during"] = engine.routed()
        after = [engine.round_trip(TRANSFER_BLOCKS) for _ in range(20)]

        def rates(samples):
            samples = [x for x in samples if x[0] == x[0] and x[1] == x[1]]  # no failed ones
            if not samples:
                return None
            st = statistics.median(n_bytes / s for s, _, _ in samples) / 1e9
            ld = statistics.median(n_bytes / t for _, t, _ in samples) / 1e9
            return {"transfers": len(samples), "store_gbps": st, "load_gbps": ld,
                    "store_ratio": st / ceiling_gbps["gpu_to_cpu"],
                    "load_ratio": ld / ceiling_gbps["cpu_to_gpu"],
                    "exact": all(e for _, _, e in samples)}

        out["during_pinning"], out["after_pinning"] = rates(during), rates(after)
        out["failed_transfers"] = engine.failed
        engine.worker.close()
        client.close()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait()
        out["serve_log_tail"] = open(os.path.join(work, "serve.log")).read()[-3000:]
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--fraction", type=float, default=0.75)
    p.add_argument("--gib", type=int, help="region size in GiB (default: fraction of RAM)")
    p.add_argument("--skip-plain", action="store_true")
    p.add_argument("--json")
    p.add_argument("--smoke-cpu", action="store_true",
                   help="host caches, no GPU: checks the script runs (no figure is valid)")
    p.add_argument("--idle", action="store_true",
                   help="no transfers while the slice is pinned: the preparation's own rate")
    args = p.parse_args()
    global DEVICE, IDLE
    IDLE = args.idle
    if args.smoke_cpu:
        DEVICE = "cpu"
    total = mem_total()
    gib = args.gib or int(total * args.fraction) // GIB
    num_bytes = gib * GIB
    gpu = torch.cuda.get_device_name(0) if DEVICE == "cuda" else "none (smoke run)"
    say(f"host RAM {total / GIB:.1f} GiB; region {gib} GiB ({num_bytes / total:.0%}); "
        f"GPU {gpu}; {os.cpu_count()} CPUs")
    result: dict = {"ram_bytes": total, "region_bytes": num_bytes, "gpu": gpu}
    result["ceiling_gbps"] = c = ceiling() if DEVICE == "cuda" else {
        "gpu_to_cpu": 1.0, "cpu_to_gpu": 1.0, "both": 1.0}
    say("ceiling " + " ".join(f"{k} {v:.1f}" for k, v in c.items()) + " GB/s")
    from tiercache.config.sections import RegionConfig
    threads = RegionConfig().prefault_threads
    if not args.skip_plain:
        result["plain"] = plain = plain_process(num_bytes, threads)
        say("plain process: " + ", ".join(f"{k} {v:.2f}" for k, v in plain.items())
            + f" (threads {threads}; {num_bytes / GIB / plain['total_s']:.2f} GiB/s overall)")
    result["tiercache"] = tc = tiercache_run(num_bytes, c)
    log_tail = tc.pop("serve_log_tail")
    say("tiercache: " + json.dumps(tc, indent=1))
    say("serve log tail:\n" + log_tail[-1500:])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result | {"serve_log_tail": log_tail}, f, indent=1)


if __name__ == "__main__":
    main()
