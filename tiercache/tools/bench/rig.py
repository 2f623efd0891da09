"""The GPU rig: one pinned host buffer and one GPU buffer carved per workload, the real
planner and backend registry over them, and GPU-event timing."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from tiercache.backends import create_backend
from tiercache.backends.base import BackendContext, CopyBackend, Ordering, Plan, Submission
from tiercache.backend_kind import BackendKind
from tiercache.config import Config
from tiercache.errors import BackendError, ConfigError
from tiercache.pages import PageArray
from tiercache.planning.planner import TransferPlanner
from tiercache.planning.plans import CopyPlan
from tiercache.specs import CPULoadStoreSpec, Direction, GPULoadStoreSpec, TransferSpec
from tiercache.tools.bench.workloads import GPU_TRANSFERS, HOST_TRANSFERS, MIB, Workload

SLACK_BYTES = 64 * MIB
NUM_STREAMS = 3  # store, load, matmul


def submit_now(backend: CopyBackend, plan: Plan, stream: Any) -> Submission:
    """``plan`` on ``stream`` outside the handlers (no events), waited for until issued, so
    work enqueued on ``stream`` after this call is ordered after it."""
    submission = backend.submit(plan, Ordering(stream))
    status = submission.wait_issued()
    if status:
        raise BackendError(f"the {backend.kind.label} backend's issuing thread failed: "
                           f"CUresult {status}")
    return submission


def _ce_stream_loads(context: BackendContext) -> CopyBackend:
    from tiercache.backends.ce import CeBackend
    from tiercache.device.driver import SrcAccessOrder, device_index

    return CeBackend(device_index(context.device), load_access_order=SrcAccessOrder.STREAM)


def _staged_ring(chunk_mib: int, num_ring_slots: int, context: BackendContext) -> CopyBackend:
    from tiercache.device.driver import device_index
    from tiercache.backends.staged.backend import StagedBackend

    return StagedBackend(device_index(context.device), chunk_bytes=chunk_mib * MIB,
                         num_ring_slots=num_ring_slots, geometry=context.geometry)


def _staged_python(context: BackendContext) -> CopyBackend:
    from tiercache.device.driver import device_index
    from tiercache.backends.staged.backend import StagedBackend

    return StagedBackend(device_index(context.device), geometry=context.geometry, native=False)


# Variants of a kind with non-default settings, for A/B runs: name -> (kind, factory).
VARIANTS: dict[str, tuple[BackendKind, Callable[[BackendContext], CopyBackend]]] = {
    "ce-stream": (BackendKind.CE, _ce_stream_loads),  # loads with srcAccessOrder STREAM
    # the staged pipeline issued from Python on the caller's thread (no native chunk loop)
    "staged-python": (BackendKind.STAGED, _staged_python),
}
_STAGED_RING = re.compile(r"staged-(\d+)-(\d+)")  # staged-CHUNKMIB-SLOTS, e.g. staged-32-2


@dataclass(frozen=True)
class BenchBackend:
    """A backend as ``--backend`` names it: a kind's config name (built by the registry,
    as a worker builds it), or a variant of a kind with other settings."""

    label: str
    kind: BackendKind
    factory: Callable[[BackendContext], CopyBackend] | None = None  # None: the registry's

    @classmethod
    def parse(cls, text: str) -> BenchBackend:
        if text in VARIANTS:
            return cls(text, *VARIANTS[text])
        ring = _STAGED_RING.fullmatch(text)
        if ring:
            chunk_mib, slots = (int(g) for g in ring.groups())
            return cls(text, BackendKind.STAGED, partial(_staged_ring, chunk_mib, slots))
        try:
            kind = BackendKind.parse(text, "--backend")
        except ConfigError as e:
            raise ConfigError(f"{e}, or a variant: {', '.join(VARIANTS)}, "
                              "staged-CHUNKMIB-SLOTS") from None
        return cls(kind.label, kind)

    def create(self, context: BackendContext) -> CopyBackend:
        if self.factory is None:
            return create_backend(self.kind, context)
        return self.factory(context)


@dataclass
class RigPlans:
    """One workload's planner over the rig's buffers, a store and a disjoint load (spec
    and plan), and one-block specs for the latency figure."""

    planner: TransferPlanner
    store_spec: TransferSpec
    load_spec: TransferSpec
    store: CopyPlan
    load: CopyPlan
    one_store_spec: TransferSpec
    one_load_spec: TransferSpec

    def make(self, backend: CopyBackend, direction: Direction, spec: TransferSpec) -> Plan:
        """The plan ``backend`` takes for ``spec`` (its ``plan_form``, as a handler asks)."""
        return self.planner.plan_as(backend.plan_form, direction, spec)

    def for_backend(self, built: dict[Direction, CopyBackend]) -> tuple[Plan, Plan]:
        """(store plan, load plan) in the form each direction's backend takes."""
        g2c, c2g = Direction.GPU_TO_CPU, Direction.CPU_TO_GPU
        return (self.make(built[g2c], g2c, self.store_spec),
                self.make(built[c2g], c2g, self.load_spec))


class GpuRig:
    """One pinned host buffer and one GPU buffer, carved per workload."""

    def __init__(self, device: int, transfer_bytes: int):
        import torch

        self.torch = torch
        self.device = torch.device("cuda", device)
        torch.cuda.set_device(self.device)
        self.transfer_bytes = transfer_bytes
        self.host = torch.empty(HOST_TRANSFERS * transfer_bytes + SLACK_BYTES,
                                dtype=torch.uint8, pin_memory=True)
        self.gpu = torch.empty(GPU_TRANSFERS * transfer_bytes + SLACK_BYTES,
                               dtype=torch.uint8, device=self.device)
        self.host.fill_(0x5A)
        self.gpu.random_(0, 256)
        self.streams = [torch.cuda.Stream(device=self.device) for _ in range(NUM_STREAMS)]
        self.ceiling_gbps: dict[str, float] = {}

    # ------------------------------------------------------------ workloads
    def page_arrays(self, w: Workload) -> tuple[tuple[PageArray, ...], tuple[PageArray, ...]]:
        """Per-layer GPU tensors of ``GPU_TRANSFERS`` transfers' blocks, and region rows."""
        gpu_blocks = GPU_TRANSFERS * w.blocks_per_transfer
        layout = w.host_layout()
        gpu = tuple(PageArray(self.gpu.data_ptr() + t * gpu_blocks * w.page_bytes, gpu_blocks,
                              w.page_bytes, w.page_bytes) for t in range(w.num_tensors))
        cpu = tuple(PageArray(self.host.data_ptr() + layout.page_offsets[t], layout.num_blocks,
                              layout.row_stride, w.page_bytes) for t in range(w.num_tensors))
        return gpu, cpu

    def plans(self, w: Workload, seed: int = 0) -> RigPlans:
        """The planner over the workload's pages; a store set and a disjoint load set of
        random blocks."""
        rng = np.random.default_rng(seed)
        b = w.blocks_per_transfer
        planner = TransferPlanner(*self.page_arrays(w), 1)
        gpu_blocks = rng.permutation(GPU_TRANSFERS * b)
        rows = rng.permutation(HOST_TRANSFERS * b)
        store = (GPULoadStoreSpec(gpu_blocks[:b]), CPULoadStoreSpec(rows[:b]))
        load = (CPULoadStoreSpec(rows[b:2 * b]), GPULoadStoreSpec(gpu_blocks[b:2 * b]))
        g2c, c2g = Direction.GPU_TO_CPU, Direction.CPU_TO_GPU
        return RigPlans(planner, store, load, planner.plan(g2c, store), planner.plan(c2g, load),
                        (GPULoadStoreSpec(gpu_blocks[:1]), CPULoadStoreSpec(rows[:1])),
                        (CPULoadStoreSpec(rows[b:b + 1]), GPULoadStoreSpec(gpu_blocks[b:b + 1])))

    def backends(self, backend: BenchBackend, w: Workload, planner: TransferPlanner,
                 zero_copy_bytes: int = Config.zero_copy_bytes) -> dict[Direction, CopyBackend]:
        """Both directions of ``backend`` over the workload's pages (pinned host rows),
        given the planner's geometry and the zero-copy bound as a worker gives them
        (block-level backends use the geometry; the bound defaults to the config's)."""
        from tiercache.device.streams import CudaStreams

        geometry = planner.geometry
        gpu, cpu = geometry.gpu_pages, geometry.cpu_pages
        return {d: backend.create(BackendContext(d, gpu, cpu, self.device, True,
                                                 CudaStreams(self.device), geometry,
                                                 zero_copy_bytes))
                for d in Direction}

    # ------------------------------------------------------------ timing
    def time_gpu(self, submit: Callable[[], object], stream, reps: int, warm: int = 2,
                 stat: Callable = np.median) -> float:
        """``stat`` of the GPU seconds ``submit()`` puts on ``stream``, after ``warm`` runs."""
        event = partial(self.torch.cuda.Event, enable_timing=True)
        start, end = event(), event()
        seconds = []
        for rep in range(warm + reps):
            start.record(stream)
            token = submit()
            end.record(stream)
            end.synchronize()
            del token
            if rep >= warm:
                seconds.append(start.elapsed_time(end) / 1e3)
        return stat(seconds)

    def time_both(self, submit_store: Callable[[object], object],
                  submit_load: Callable[[object], object], reps: int, warm: int = 2,
                  stat: Callable[[list[float]], Any] = np.median) -> Any:
        """The same for a store and a load started together on two streams (until both end):
        ``stat`` of the seconds (``list``: all of them)."""
        event = partial(self.torch.cuda.Event, enable_timing=True)
        s1, s2 = self.streams[0], self.streams[1]
        start, e1, e2 = event(), event(), event()
        seconds = []
        for rep in range(warm + reps):
            start.record(s1)
            s2.wait_event(start)
            t1 = submit_store(s1)
            t2 = submit_load(s2)
            e1.record(s1)
            e2.record(s2)
            e1.synchronize()
            e2.synchronize()
            del t1, t2
            if rep >= warm:
                seconds.append(max(start.elapsed_time(e1), start.elapsed_time(e2)) / 1e3)
        return stat(seconds)

    def ceiling(self, reps: int) -> dict[str, float]:
        """GB/s of one large pinned copy each way and both at once; best of ``2 * reps``
        (the ceiling is what the link can do; backends get medians)."""
        reps = 2 * reps
        n = self.transfer_bytes
        h, h2 = self.host[:n], self.host[n:2 * n]
        d, d2 = self.gpu[:n], self.gpu[n:2 * n]
        s1 = self.streams[0]

        def copy(dst, src, stream) -> None:
            with self.torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)

        h2d = n / self.time_gpu(lambda: copy(d, h, s1), s1, reps, stat=min)
        d2h = n / self.time_gpu(lambda: copy(h, d, s1), s1, reps, stat=min)
        both = 2 * n / self.time_both(lambda s: copy(h2, d2, s), lambda s: copy(d, h, s), reps,
                                      stat=min)
        self.ceiling_gbps = {"gpu_to_cpu": d2h / 1e9, "cpu_to_gpu": h2d / 1e9, "both": both / 1e9}
        return self.ceiling_gbps


def probe_rig(reps: int = 5) -> tuple[GpuRig, dict[str, float]]:
    """A rig on GPU 0 of ``TRANSFER_BYTES`` transfers, its ceiling measured (best of
    ``2 * reps``) and printed: how the probes in ``benchmarks/`` start."""
    from tiercache.tools.bench.workloads import TRANSFER_BYTES

    rig = GpuRig(0, TRANSFER_BYTES)
    ceiling = rig.ceiling(reps)
    print("ceiling " + " ".join(f"{k} {v:.1f}" for k, v in ceiling.items()) + " GB/s",
          flush=True)
    return rig, ceiling
