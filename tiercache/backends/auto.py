"""``auto``: pick a backend per direction from the page sizes and a short calibration.

Rules, in order (each choice carries its reason, which the worker logs and whose
backend kind it records in the rank's stats block):

1. Host memory not pinned: ``ce`` (the only GPU path that may read pageable memory;
   the pin state is exported separately).
2. Every GPU page ≥ ``LARGE_PAGE_BYTES``: ``ce`` — the copy engines reach the PCIe
   ceiling on such units by themselves, and need no staging memory.
3. Otherwise time the candidates that leave the SMs to the model — ``ce`` and
   ``staged`` — each as it will run for the rank: on scratch memory shaped like the
   rank's KV cache (one tensor per page size, scattered blocks, host rows), through a
   planner over that scratch, so ``ce`` takes merged page plans and ``staged`` block
   plans issued by its native chunk loop. The rate is *marginal*: what a
   ``CALIBRATION_BYTES`` transfer adds over one a quarter that size (a single small
   transfer overweights fixed per-transfer costs). A candidate whose ``submit`` holds
   the calling thread for more than ``HOST_SHARE_LIMIT`` of the large transfer's time
   is passed over: that thread drives the model and the other direction (``ce`` on 32
   KiB pages moves at the PCIe ceiling but walks ~0.5 µs of driver time per page, ~9 ms
   of a 10 ms transfer). The share is the whole call's, not a marginal one: a noisy
   small run cannot make a slow call look cheap. Among the rest, the higher rate wins.

When ``staged`` wins it takes every plan of the rank as block plans, issued by its
native chunk loop (one block goes through it faster than through ``ce``: docs/benchmarks.md,
"Host path"). Only where ``staged`` takes page plans (its block layout refused the
geometry) do plans of at most ``SMALL_PLAN_DESCRIPTORS`` descriptors go to ``ce``: its
Python pipeline's fixed host work per transfer (layout, table, launch, two cross-stream
hops) is more than the driver's per-descriptor cost of a small plan. The choice's
reason says which.

``kernel`` is never chosen here: it holds SMs for the whole transfer (a concurrent
matmul was measured to lose half its speed); configure it by name where latency
matters more. A calibration that fails raises ``BackendError``: nothing falls back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import numpy as np
import torch

from tiercache.backends.base import BackendContext, CopyBackend, Ordering, Plan, Submission
from tiercache.backends.ce import CeBackend
from tiercache.backend_kind import BackendKind
from tiercache.backends.staged.backend import StagedBackend
from tiercache.device.driver import CudaDriver, device_index
from tiercache.device.events import TORCH_DEVICE_ERRORS
from tiercache.errors import BackendError
from tiercache.pages import PageArray
from tiercache.planning.geometry import TransferGeometry
from tiercache.planning.planner import TransferPlanner
from tiercache.planning.plans import CopyPlan, PlanForm
from tiercache.specs import CPULoadStoreSpec, Direction, GPULoadStoreSpec

if TYPE_CHECKING:
    from tiercache.native.chunk_loop import ChunkLoop

log = logging.getLogger(__name__)

LARGE_PAGE_BYTES = 1 << 20
CALIBRATION_BYTES = 32 << 20  # per candidate and repetition: ~0.6 ms of PCIe
CALIBRATION_REPS = 3
SMALL_PLAN_DESCRIPTORS = 256
HOST_SHARE_LIMIT = 0.25  # of a transfer's GPU time the submitting thread may be held


@dataclass(frozen=True)
class AutoChoice:
    direction: Direction
    kind: BackendKind  # the chosen backend's
    reason: str
    rates_gbps: tuple[tuple[BackendKind, float], ...] = ()  # measured candidates, best first

    def describe(self) -> str:
        return f"{self.direction.label}: {self.kind.label} ({self.reason})"


class AutoBackend(CopyBackend):
    """The chosen backend, with the choice attached; ``kind`` and ``plan_form`` are the
    chosen one's. ``small``, when set (beside a ``staged`` that takes page plans), takes
    page plans of at most ``SMALL_PLAN_DESCRIPTORS`` descriptors; both then issue on the
    calling thread, so their transfers stay in submission order on the stream."""

    def __init__(self, chosen: CopyBackend, choice: AutoChoice, small: CopyBackend | None = None):
        if small is not None and (chosen.plan_form is not PlanForm.PAGES
                                  or small.plan_form is not PlanForm.PAGES):
            raise BackendError("auto: a backend for small plans only beside one that takes "
                               "page plans")
        self.chosen = chosen
        self.small = small
        self.choice = choice
        self.kind = chosen.kind
        self.plan_form = chosen.plan_form

    def submit(self, plan: Plan | None, ordering: Ordering) -> Submission:
        if self.small is not None and isinstance(plan, CopyPlan) \
                and plan.num_descriptors <= SMALL_PLAN_DESCRIPTORS:
            return self.small.submit(plan, ordering)
        return self.chosen.submit(plan, ordering)

    def transfer_loop(self, geometry: TransferGeometry) -> ChunkLoop | None:
        if self.small is not None:  # page plans, split between two backends
            return None
        return self.chosen.transfer_loop(geometry)

    def close(self) -> None:
        self.chosen.close()
        if self.small is not None:
            self.small.close()


def _candidates(device: int, driver: CudaDriver, geometry: TransferGeometry
                ) -> list[Callable[[], CopyBackend]]:
    return [lambda: CeBackend(device, driver),
            lambda: StagedBackend(device, driver=driver, geometry=geometry)]


class _Scratch:
    """GPU pages (one tensor per page size of the rank, tensor after tensor, as a KV
    cache is) and pinned host rows (each row one page of every tensor), enough blocks
    for ``CALIBRATION_BYTES`` twice over, with a planner over them; transfers take
    scattered GPU blocks and rows."""

    def __init__(self, context: BackendContext, device: torch.device):
        pages = [p.page_bytes for p in context.gpu_pages]
        block_bytes = sum(pages)
        self.num_blocks = max(2, min(CALIBRATION_BYTES // block_bytes, 4096))
        total = 2 * self.num_blocks
        self.gpu = torch.empty(total * block_bytes, dtype=torch.uint8, device=device)
        self.host = torch.empty(total * block_bytes, dtype=torch.uint8, pin_memory=True)
        offsets = np.cumsum([0] + pages[:-1]).tolist()
        gpu_pages = [PageArray(self.gpu.data_ptr() + total * o, total, p, p)
                     for o, p in zip(offsets, pages)]
        cpu_pages = [PageArray(self.host.data_ptr() + o, total, block_bytes, p)
                     for o, p in zip(offsets, pages)]
        self.planner = TransferPlanner(gpu_pages, cpu_pages, 1)
        rng = np.random.default_rng(0)
        self._gpu_blocks = rng.permutation(total)[:self.num_blocks]
        self._rows = rng.permutation(total)[:self.num_blocks]

    def plan(self, backend: CopyBackend, direction: Direction, num_blocks: int) -> Plan:
        """The first ``num_blocks`` blocks, planned as ``backend`` takes them."""
        gpu = GPULoadStoreSpec(self._gpu_blocks[:num_blocks])
        cpu = CPULoadStoreSpec(self._rows[:num_blocks])
        return self.planner.plan_as(backend.plan_form, direction, direction.src_dst(gpu, cpu))


def _time_backend(backend: CopyBackend, plan: Plan, stream: torch.cuda.Stream
                  ) -> tuple[float, float]:
    """Median seconds of one transfer, GPU-timed, and of its ``submit`` call on the
    host, after one warm-up."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    seconds, host_seconds = [], []
    for rep in range(CALIBRATION_REPS + 1):
        start.record(stream)
        t0 = time.perf_counter()
        token = backend.submit(plan, Ordering(stream))
        host_s = time.perf_counter() - t0
        if token.wait_issued():  # a native loop's transfer is on the stream only then
            raise BackendError(f"{backend.kind.label}'s issuing thread failed")
        end.record(stream)
        end.synchronize()
        del token
        if rep:
            seconds.append(start.elapsed_time(end) / 1e3)
            host_seconds.append(host_s)
    return float(np.median(seconds)), float(np.median(host_seconds))


@dataclass(frozen=True)
class _Measured:
    backend: CopyBackend
    rate_bps: float  # marginal bytes per GPU second
    host_share: float  # marginal host seconds per GPU second

    @property
    def preference(self) -> tuple[bool, float]:
        """Sort key: light on the host first, then fastest."""
        return self.host_share > HOST_SHARE_LIMIT, -self.rate_bps


def _measure(backend: CopyBackend, small: Plan, large: Plan,
             stream: torch.cuda.Stream) -> _Measured:
    """The rate ``large`` adds over ``small`` (fixed per-transfer costs cancel; the plain
    rate of ``large`` when timing noise hides the difference) and the host share of the
    whole ``large`` call."""
    t_small, _ = _time_backend(backend, small, stream)
    t_large, h_large = _time_backend(backend, large, stream)
    share = h_large / t_large
    if t_large <= t_small:
        return _Measured(backend, large.num_bytes / t_large, share)
    return _Measured(backend, (large.num_bytes - small.num_bytes) / (t_large - t_small), share)


def choose(context: BackendContext) -> tuple[AutoChoice, CopyBackend]:
    """Decide for ``context.direction``; returns the choice and the built backend."""
    direction = context.direction
    device = device_index(context.device)
    driver = CudaDriver()
    if not driver.has_batch:
        raise BackendError(f"auto: CUDA driver {driver.driver_version} has no "
                           "cuMemcpyBatchAsync; configure backend = 'kernel' or 'ce_loop' "
                           "explicitly")
    if not context.host_registered:
        return (AutoChoice(direction, BackendKind.CE, "host memory is not page-locked"),
                CeBackend(device, driver))
    smallest = min(p.page_bytes for p in context.gpu_pages)
    if smallest >= LARGE_PAGE_BYTES:
        return (AutoChoice(direction, BackendKind.CE,
                           f"every GPU page >= {LARGE_PAGE_BYTES >> 20} MiB "
                           f"(smallest {smallest} B): copy engines need no staging"),
                CeBackend(device, driver))

    torch_device = torch.device("cuda", device)
    started = time.perf_counter()
    try:
        scratch = _Scratch(context, torch_device)
        stream = torch.cuda.Stream(device=torch_device)
        measured = []
        for build in _candidates(device, driver, scratch.planner.geometry):
            backend = build()
            large = scratch.plan(backend, direction, scratch.num_blocks)
            small = scratch.plan(backend, direction, max(1, scratch.num_blocks // 4))
            measured.append(_measure(backend, small, large, stream))
    except (BackendError, *TORCH_DEVICE_ERRORS) as e:
        raise BackendError(f"auto: calibration for {direction.label} failed: {e}") from e
    measured.sort(key=lambda m: m.preference)
    best = measured[0]
    for other in measured[1:]:
        other.backend.close()
    chosen = best.backend
    if chosen.kind is BackendKind.STAGED:
        chosen.close()  # calibrated on the scratch's geometry; the rank's own has its layout
        chosen = StagedBackend(device, driver=driver, geometry=context.geometry,
                               zero_copy_bytes=context.zero_copy_limit)
    elapsed_ms = (time.perf_counter() - started) * 1e3
    summary = ", ".join(f"{m.backend.kind.label} {m.rate_bps / 1e9:.1f} GB/s "
                        f"(host {m.host_share:.0%})"
                        for m in measured)
    reason = (f"fastest SM-free path holding the host <= {HOST_SHARE_LIMIT:.0%} of a transfer "
              f"at {smallest} B pages: {summary}, marginal rates ({scratch.num_blocks} blocks "
              f"of {len(context.gpu_pages)} pages, {elapsed_ms:.0f} ms calibration)")
    return (AutoChoice(direction, best.backend.kind, reason,
                       tuple((m.backend.kind, round(m.rate_bps / 1e9, 2)) for m in measured)),
            chosen)


def create(context: BackendContext) -> AutoBackend:
    choice, backend = choose(context)
    small = None
    if isinstance(backend, StagedBackend) and backend.plan_form is PlanForm.PAGES:
        small = CeBackend(device_index(context.device), backend.driver)
        choice = replace(choice, reason=f"{choice.reason}; page plans of <= "
                                        f"{SMALL_PLAN_DESCRIPTORS} descriptors on ce")
    log.info("transfer backend %s", choice.describe())
    return AutoBackend(backend, choice, small)
