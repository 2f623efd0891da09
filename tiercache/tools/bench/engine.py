"""The engine's pattern: what one engine step pays, as distributions.

An engine step submits its store and its load back to back from one thread
(``transfer_async`` of each, through the real handlers), then goes on with its own Python
while the copies run, and picks the results up with ``get_finished``. Here, per step:

* the engine's own Python (``STEP_PYTHON_S`` of it) before the calls, so the calls meet
  caches as a step leaves them;
* store and load of 256 scattered blocks each, in one order or the other; the second call
  is made with the first transfer in flight;
* ``get_finished`` polled until both are reported, the GIL let go between polls as an
  engine waiting on its GPU lets it go: the step's both-ways rate.

All the while another Python thread of the process runs Python in bursts
(``BusyPython``: ``BUSY_BURST_S`` of work, then ``BUSY_IDLE_S`` blocked), as an engine's
I/O and RPC threads do: a native call that lets go of the GIL on the step's thread may
find it taken by a burst when it returns.

Figures: both-ways rate per order (median and minimum, against the sum of the two
one-way ceilings), the host time of every ``transfer_async`` call (p50, p99), a one-block
load from call to result (p50, p99; the wire time of its bytes beside it), seen by a
poller that lets go of the GIL between polls and by one that keeps it (``spin``: the other
thread's bursts cannot delay seeing it), and the controls: two plain torch copies of the
same bytes, issued the same way on two streams in the same process, and one plain torch copy
of a block's bytes for the one-block figure. Two counts say where a slow call's time went:
the calls during which the other thread ran (the call lost the GIL, or waited for it), and
the garbage collections during the pattern with the longest one.
"""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from tiercache.backends.base import CopyBackend
from tiercache.specs import Direction
from tiercache.tools.bench.rig import GpuRig, RigPlans

G2C, C2G = Direction.GPU_TO_CPU, Direction.CPU_TO_GPU
STEP_PYTHON_S = 0.001
BUSY_BURST_S = 100e-6
BUSY_IDLE_S = 400e-6
WARM_STEPS = 5
ONE_BLOCK_STEPS = 200
ORDERS = ("store_first", "load_first")


class BusyPython:
    """A thread running Python in bursts until closed (an engine's other threads)."""

    def __init__(self) -> None:
        self._stop = threading.Event()
        self.rounds = 0
        self._thread = threading.Thread(target=self._run, name="bench-busy-python",
                                        daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            python_for(BUSY_BURST_S)
            self.rounds += 1
            time.sleep(BUSY_IDLE_S)

    def __enter__(self) -> BusyPython:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


class _GcPauses:
    """The garbage collections while entered: how many, and the longest (seconds)."""

    def __init__(self) -> None:
        self.count, self.max_s, self._t0 = 0, 0.0, 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.count += 1
            self.max_s = max(self.max_s, time.perf_counter() - self._t0)

    def __enter__(self) -> _GcPauses:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


def python_work(n: int) -> int:
    """Interpreter work of the kind a step does: small objects built and dropped."""
    d = {i: (i, str(i)) for i in range(n)}
    return sum(len(v[1]) for v in d.values())


def python_for(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        python_work(50)


def run_step(handlers: Any, jobs: Iterator[int], specs: list, spin: bool = False,
             watch: Callable[[], int] | None = None) -> tuple[float, list[float], int]:
    """Submit ``specs`` back to back through ``handlers`` (job ids from ``jobs``) and poll
    ``get_finished`` until every one reported: (wall seconds from the first call, each
    call's host seconds, how many calls ``watch()`` changed across). ``spin``: poll
    keeping the GIL (the result is seen when it is there); else let it go between polls,
    as a step waiting on its GPU does. A failed transfer raises ``AssertionError``."""
    t0 = time.perf_counter()
    pending, took, changed = set(), [], 0
    for spec in specs:
        job = next(jobs)
        before = watch() if watch is not None else 0
        c0 = time.perf_counter()
        handlers.transfer_async(job, spec)
        took.append(time.perf_counter() - c0)
        changed += watch is not None and watch() != before
        pending.add(job)
    while pending:
        for result in handlers.get_finished():
            if not result.success:
                raise AssertionError(f"transfer {result.job_id} failed")
            pending.discard(result.job_id)
        if not spin:
            time.sleep(0)
    return time.perf_counter() - t0, took, changed


def _pcts(values: list[float], scale: float = 1e6) -> tuple[float, float]:
    a = np.asarray(values) * scale
    return float(np.percentile(a, 50)), float(np.percentile(a, 99))


def engine_pattern(rig: GpuRig, plans: RigPlans, built: dict[Direction, CopyBackend],
                   steps: int, ceiling: dict[str, float]) -> dict[str, Any]:
    """The module docstring's figures for one workload and backend (``steps`` per order)."""
    from tiercache.device.streams import CudaStreams
    from tiercache.transfer.wiring import build_handlers

    handlers = build_handlers(plans.planner, built, CudaStreams(rig.device))
    # (benchmarks/engine_pattern.py runs this module on older trees too, whose handlers have
    # no native path)
    native = [getattr(handlers.handler(d), "native", False) for d in (G2C, C2G)]
    jobs = iter(range(1, 1 << 30))
    calls: dict[Direction, list[float]] = {G2C: [], C2G: []}
    both_bytes = plans.store.num_bytes + plans.load.num_bytes
    sum_ceiling = (ceiling["gpu_to_cpu"] + ceiling["cpu_to_gpu"]) * 1e9

    interrupted = [0, 0]  # calls during which the other thread ran, calls

    def step(specs: list, spin: bool = False) -> tuple[float, list[float]]:
        """One step: the step's Python, then ``run_step`` (counting the calls during which
        the other thread ran)."""
        python_for(STEP_PYTHON_S)
        wall, took, changed = run_step(handlers, jobs, specs, spin, lambda: busy.rounds)
        interrupted[0] += changed
        interrupted[1] += len(specs)
        return wall, took

    out: dict[str, Any] = {"pattern_native_store": native[0], "pattern_native_load": native[1]}
    pauses = _GcPauses()
    with BusyPython() as busy, pauses:
        for order in ORDERS:
            directions = [G2C, C2G] if order == "store_first" else [C2G, G2C]
            # ``d is G2C``, not ``d.stores``: this module is copied into older trees
            specs = [plans.store_spec if d is G2C else plans.load_spec for d in directions]
            walls = []
            for i in range(WARM_STEPS + steps):
                wall, took = step(specs)
                if i >= WARM_STEPS:
                    walls.append(wall)
                    for d, t in zip(directions, took):
                        calls[d].append(t)
            rates = both_bytes / np.asarray(walls) / sum_ceiling
            out[f"pattern_{order}_ratio"] = float(np.median(rates))
            out[f"pattern_{order}_min_ratio"] = float(rates.min())
        one_walls, one_calls, spin_walls = [], [], []
        for i in range(WARM_STEPS + ONE_BLOCK_STEPS):
            wall, took = step([plans.one_load_spec])
            spun, _ = step([plans.one_load_spec], spin=True)
            if i >= WARM_STEPS:
                one_walls.append(wall)
                spin_walls.append(spun)
                one_calls += took
        one_bytes = plans.one_load_spec[1].block_ids.size * sum(
            g.pair_bytes for g in plans.planner.groups)
        torch_one = _torch_one_block(rig, one_bytes)
        out["pattern_control_ratio"], out["pattern_control_min_ratio"] = \
            _torch_control(rig, plans, steps, sum_ceiling)
        out["pattern_busy_rounds"] = busy.rounds
    out["pattern_calls_interrupted"] = interrupted[0] / max(interrupted[1], 1)
    out["pattern_gc_collections"], out["pattern_gc_max_ms"] = pauses.count, pauses.max_s * 1e3
    handlers.shutdown()
    wire_s = one_bytes / (ceiling["cpu_to_gpu"] * 1e9)
    out["pattern_store_call_p50_us"], out["pattern_store_call_p99_us"] = _pcts(calls[G2C])
    out["pattern_load_call_p50_us"], out["pattern_load_call_p99_us"] = _pcts(calls[C2G])
    out["pattern_one_call_p50_us"], out["pattern_one_call_p99_us"] = _pcts(one_calls)
    out["pattern_one_block_p50_us"], out["pattern_one_block_p99_us"] = _pcts(one_walls)
    out["pattern_one_block_spin_p50_us"], out["pattern_one_block_spin_p99_us"] = \
        _pcts(spin_walls)
    out["pattern_one_block_torch_p50_us"], out["pattern_one_block_torch_p99_us"] = \
        _pcts(torch_one)
    out["pattern_one_block_wire_us"] = wire_s * 1e6
    out["pattern_one_block_target_us"] = (1.5 * wire_s + 20e-6) * 1e6
    return out


def _torch_one_block(rig: GpuRig, num_bytes: int) -> list[float]:
    """Call to result of one plain torch copy of a block's bytes (host to GPU), issued and
    polled as the one-block loads are (the GIL let go between polls): the floor of "copy
    one block and see it done" in this process."""
    torch = rig.torch
    src, dst, stream = rig.host[:num_bytes], rig.gpu[:num_bytes], rig.streams[0]
    end = torch.cuda.Event()
    walls = []
    for i in range(WARM_STEPS + ONE_BLOCK_STEPS):
        python_for(STEP_PYTHON_S)
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
            end.record(stream)
        while not end.query():
            time.sleep(0)
        if i >= WARM_STEPS:
            walls.append(time.perf_counter() - t0)
    return walls


def _torch_control(rig: GpuRig, plans: RigPlans, steps: int, sum_ceiling: float
                   ) -> tuple[float, float]:
    """Both-ways rate of two plain torch copies of the transfers' sizes, issued back to
    back on two streams each step as the pattern issues its calls (median, minimum)."""
    torch = rig.torch
    n_store, n_load = plans.store.num_bytes, plans.load.num_bytes
    host, gpu = rig.host, rig.gpu
    store_src, store_dst = gpu[:n_store], host[:n_store]
    load_src, load_dst = host[n_store:n_store + n_load], gpu[n_store:n_store + n_load]
    s1, s2 = rig.streams[0], rig.streams[1]
    ends = [torch.cuda.Event() for _ in range(2)]
    walls = []
    for i in range(WARM_STEPS + steps):
        python_for(STEP_PYTHON_S)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for (dst, src), stream, end in zip(((store_dst, store_src), (load_dst, load_src)),
                                           (s1, s2), ends):
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
                end.record(stream)
        while not all(e.query() for e in ends):
            time.sleep(0)
        if i >= WARM_STEPS:
            walls.append(time.perf_counter() - t0)
    rates = (n_store + n_load) / np.asarray(walls) / sum_ceiling
    return float(np.median(rates)), float(rates.min())
