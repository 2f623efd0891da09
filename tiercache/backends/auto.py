"""``auto``: pick a backend per direction from the page sizes and a short calibration.

Rules, in order (each choice carries its reason, which the worker logs and whose
backend kind it records in the rank's stats block):

1. Host memory not pinned: ``ce`` (the only GPU path that may read pageable memory;
   the pin state is exported separately).
2. Every GPU page ≥ ``LARGE_PAGE_BYTES``: ``ce`` — the copy engines reach the PCIe
   ceiling on such units by themselves, and need no staging memory.
3. Otherwise time the candidates that leave the SMs to the model — ``ce`` and
   ``staged`` — on scratch memory shaped like this rank's pages and host rows (in the
   planner's host order). Both figures are *marginal*: what a ``CALIBRATION_BYTES``
   transfer adds over one a quarter that size (a single small transfer overweights
   fixed per-transfer costs). A candidate whose submission holds the calling thread
   for more than ``HOST_SHARE_LIMIT`` of the transfer's time is passed over: that
   thread drives the model and the other direction (``ce`` on 32 KiB pages moves at
   the PCIe ceiling but walks ~0.5 µs of driver time per page, ~9 ms of a 10 ms
   transfer; both directions at once then reach only 0.64 of the ceiling). Among the
   rest, the higher rate wins.

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
from dataclasses import dataclass
from dataclasses import replace

import numpy as np
import torch

from tiercache.backends.base import BackendContext, CopyBackend, Ordering, Plan, Submission
from tiercache.backends.ce import CeBackend
from tiercache.backends.kind import BackendKind
from tiercache.backends.staged.backend import StagedBackend
from tiercache.device.driver import CudaDriver, device_index
from tiercache.errors import BackendError
from tiercache.planning.plans import CopyPlan, PlanForm
from tiercache.specs import Direction

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

    def close(self) -> None:
        self.chosen.close()
        if self.small is not None:
            self.small.close()


def _candidates(device: int, driver: CudaDriver) -> list[Callable[[], CopyBackend]]:
    return [lambda: CeBackend(device, driver), lambda: StagedBackend(device, driver=driver)]


class _Scratch:
    """GPU pages and pinned host rows shaped like the rank's (same page sizes, same page
    offsets inside a host row), enough blocks for ``CALIBRATION_BYTES``. Descriptors are
    block by block in ascending host rows, tensors by row offset: the planner's order."""

    def __init__(self, context: BackendContext, device: torch.device):
        gpu_page = [p.page_bytes for p in context.gpu_pages]
        host_page = [p.page_bytes for p in context.cpu_pages]
        base = context.cpu_pages[0].base_address
        offsets = [p.base_address - base for p in context.cpu_pages]
        row_stride = max(context.cpu_pages[0].block_stride_bytes,
                         max(o + p.block_bytes for o, p in zip(offsets, context.cpu_pages)))
        if any(o < 0 or o >= row_stride for o in offsets):  # pages not laid out in rows
            offsets = list(np.cumsum([0] + [p.block_bytes for p in context.cpu_pages[:-1]]))
            row_stride = sum(p.block_bytes for p in context.cpu_pages)
        block_bytes = sum(gpu_page)
        self.num_blocks = max(2, min(CALIBRATION_BYTES // block_bytes, 4096))
        self.gpu = torch.empty(self.num_blocks * 2 * block_bytes, dtype=torch.uint8, device=device)
        self.host = torch.empty(self.num_blocks * 2 * row_stride, dtype=torch.uint8,
                                pin_memory=True)
        rng = np.random.default_rng(0)
        gpu_blocks = rng.permutation(2 * self.num_blocks)[: self.num_blocks].astype(np.uint64)
        rows = rng.permutation(2 * self.num_blocks)[: self.num_blocks].astype(np.uint64)
        rows.sort()
        by_offset = np.argsort(offsets, kind="stable")
        gpu_off = np.cumsum([0] + gpu_page[:-1]).astype(np.uint64)[by_offset]
        gpu_addr = np.uint64(self.gpu.data_ptr()) + gpu_blocks[:, None] * np.uint64(block_bytes) \
            + gpu_off[None, :]
        host_addr = np.uint64(self.host.data_ptr()) + rows[:, None] * np.uint64(row_stride) \
            + np.asarray(offsets, dtype=np.uint64)[by_offset][None, :]
        self.gpu_addr = gpu_addr.ravel()
        self.host_addr = host_addr.ravel()
        sizes = np.minimum(gpu_page, host_page)[by_offset].astype(np.uint64)
        self.sizes = np.tile(sizes, self.num_blocks)
        self.num_tensors = len(gpu_page)

    def plan(self, direction: Direction, num_blocks: int) -> CopyPlan:
        """The first ``num_blocks`` blocks (at most ``self.num_blocks``)."""
        n = num_blocks * self.num_tensors
        src, dst = direction.src_dst(self.gpu_addr[:n], self.host_addr[:n])
        return CopyPlan(src, dst, self.sizes[:n], direction)


def _time_backend(backend: CopyBackend, plan: CopyPlan, stream: torch.cuda.Stream
                  ) -> tuple[float, float]:
    """Median seconds of one transfer, GPU-timed, and of its ``submit`` call on the
    host, after one warm-up (the candidates issue on the calling thread: page plans)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    seconds, host_seconds = [], []
    for rep in range(CALIBRATION_REPS + 1):
        start.record(stream)
        t0 = time.perf_counter()
        token = backend.submit(plan, Ordering(stream))
        host_s = time.perf_counter() - t0
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


def _measure(backend: CopyBackend, small: CopyPlan, large: CopyPlan,
             stream: torch.cuda.Stream) -> _Measured:
    """What ``large`` adds over ``small`` (fixed per-transfer costs cancel); the plain
    figures of ``large`` when timing noise hides the difference."""
    t_small, h_small = _time_backend(backend, small, stream)
    t_large, h_large = _time_backend(backend, large, stream)
    if t_large <= t_small:
        return _Measured(backend, large.num_bytes / t_large, h_large / t_large)
    extra_s = t_large - t_small
    return _Measured(backend, (large.num_bytes - small.num_bytes) / extra_s,
                     max(h_large - h_small, 0.0) / extra_s)


def choose(context: BackendContext) -> tuple[AutoChoice, CopyBackend]:
    """Decide for ``context.direction``; returns the choice and the built backend."""
    direction = context.direction
    device = device_index(context.device)
    driver = CudaDriver()
    if not driver.has_batch:
        raise BackendError(f"auto: CUDA driver {driver.driver_version} has no "
                           "cuMemcpyBatchAsync; configure backend = 'kernel' or 'ce_loop' explicitly")
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
        large = scratch.plan(direction, scratch.num_blocks)
        small = scratch.plan(direction, max(1, scratch.num_blocks // 4))
        stream = torch.cuda.Stream(device=torch_device)
        measured = [_measure(build(), small, large, stream)
                    for build in _candidates(device, driver)]
    except (RuntimeError, BackendError) as e:
        raise BackendError(f"auto: calibration for {direction.label} failed: {e}") from e
    measured.sort(key=lambda m: m.preference)
    best = measured[0]
    for other in measured[1:]:
        other.backend.close()
    chosen = best.backend
    if chosen.kind is BackendKind.STAGED and context.planner is not None:
        chosen.close()  # calibrated on scratch pages; the rank's own has its block layout
        chosen = StagedBackend(device, driver=driver, planner=context.planner)
    elapsed_ms = (time.perf_counter() - started) * 1e3
    summary = ", ".join(f"{m.backend.kind.label} {m.rate_bps / 1e9:.1f} GB/s "
                        f"(host {m.host_share:.0%})"
                        for m in measured)
    reason = (f"fastest SM-free path holding the host <= {HOST_SHARE_LIMIT:.0%} of a transfer "
              f"at {smallest} B pages: {summary}, marginal ({large.num_descriptors} pages, "
              f"{elapsed_ms:.0f} ms calibration)")
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
