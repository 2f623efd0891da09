"""``auto``: pick a backend per direction from the page sizes and a short calibration.

Rules, in order (each choice carries its reason, which the worker logs and whose
backend code it records in the rank's stats block):

1. Host memory not pinned: ``ce`` (the only GPU path that may read pageable memory;
   the pin state is exported separately).
2. Every GPU page ≥ ``LARGE_PAGE_BYTES``: ``ce`` — the copy engines reach the PCIe
   ceiling on such units by themselves, and need no staging memory.
3. Otherwise time the candidates that leave the SMs to the model — ``ce`` and
   ``staged`` — on scratch memory shaped like this rank's pages and host rows
   (``CALIBRATION_BYTES``, a few ms), and take the fastest.

When ``staged`` wins, plans of at most ``SMALL_PLAN_DESCRIPTORS`` descriptors still go
to ``ce``: staging costs ~0.1–0.2 ms of fixed host work per transfer (layout, table,
launch), more than the driver's ~0.7 µs per descriptor on a small plan, and one block
(64 pages) then completes in ~75 µs instead of ~200 (H100, 32 KiB pages).

``kernel`` is never chosen here: it holds SMs for the whole transfer (a concurrent
matmul was measured to lose half its speed); configure it by name where latency
matters more. A calibration that fails raises ``BackendError``: nothing falls back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from tiercache.backends.base import CopyBackend, CopyPlan
from tiercache.backends.ce import CeBackend, device_index
from tiercache.backends.driver import CudaDriver
from tiercache.backends.staged import StagedBackend
from tiercache.errors import BackendError
from tiercache.stats import Direction

log = logging.getLogger(__name__)

LARGE_PAGE_BYTES = 1 << 20
CALIBRATION_BYTES = 32 << 20  # per candidate and repetition: ~0.6 ms of PCIe
CALIBRATION_REPS = 3
SMALL_PLAN_DESCRIPTORS = 256


@dataclass(frozen=True)
class AutoChoice:
    direction: Direction
    name: str  # the chosen backend's name, e.g. 'staged'
    reason: str
    rates_gbps: tuple[tuple[str, float], ...] = ()  # measured candidates, best first

    def describe(self) -> str:
        return f"{self.direction.label}: {self.name} ({self.reason})"


class AutoBackend(CopyBackend):
    """The chosen backend, with the choice attached; ``code`` is the chosen one's.

    ``small``, when set, takes plans of at most ``SMALL_PLAN_DESCRIPTORS`` descriptors.
    """

    def __init__(self, chosen: CopyBackend, choice: AutoChoice, small: CopyBackend | None = None):
        self.chosen = chosen
        self.small = small
        self.choice = choice
        self.code = chosen.code
        self.name = choice.name

    def copy_async(self, plan: CopyPlan, stream: Any) -> Any:
        if self.small is not None and plan.num_descriptors <= SMALL_PLAN_DESCRIPTORS:
            return self.small.copy_async(plan, stream)
        return self.chosen.copy_async(plan, stream)

    def close(self) -> None:
        self.chosen.close()
        if self.small is not None:
            self.small.close()


Candidate = tuple[str, Callable[[], CopyBackend]]


def _candidates(device: int, driver: CudaDriver) -> list[Candidate]:
    return [
        ("ce", lambda: CeBackend(device, driver)),
        ("staged", lambda: StagedBackend(device, driver=driver)),
    ]


class _Scratch:
    """GPU pages and pinned host rows shaped like the rank's (same page sizes, same page
    offsets inside a host row), enough blocks for ``CALIBRATION_BYTES``."""

    def __init__(self, context, device: torch.device):
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
        gpu_off = np.cumsum([0] + gpu_page[:-1]).astype(np.uint64)
        gpu_addr = np.uint64(self.gpu.data_ptr()) + gpu_blocks[None, :] * np.uint64(block_bytes) \
            + gpu_off[:, None]
        host_addr = np.uint64(self.host.data_ptr()) + rows[None, :] * np.uint64(row_stride) \
            + np.asarray(offsets, dtype=np.uint64)[:, None]
        self.gpu_addr = gpu_addr.ravel()
        self.host_addr = host_addr.ravel()
        self.sizes = np.repeat(np.minimum(gpu_page, host_page), self.num_blocks).astype(np.uint64)

    def plan(self, direction: Direction) -> CopyPlan:
        if direction == Direction.GPU_TO_CPU:
            return CopyPlan(self.gpu_addr, self.host_addr, self.sizes, direction)
        return CopyPlan(self.host_addr, self.gpu_addr, self.sizes, direction)


def _time_backend(backend: CopyBackend, plan: CopyPlan, stream: torch.cuda.Stream) -> float:
    """Median seconds of one transfer, GPU-timed, after one warm-up."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    seconds = []
    for rep in range(CALIBRATION_REPS + 1):
        start.record(stream)
        token = backend.copy_async(plan, stream)
        end.record(stream)
        end.synchronize()
        del token
        if rep:
            seconds.append(start.elapsed_time(end) / 1e3)
    return float(np.median(seconds))


def choose(context) -> tuple[AutoChoice, CopyBackend]:
    """Decide for ``context.direction``; returns the choice and the built backend."""
    direction = context.direction
    device = device_index(context.device)
    driver = CudaDriver()
    if not driver.has_batch:
        raise BackendError(f"auto: CUDA driver {driver.driver_version} has no "
                           "cuMemcpyBatchAsync; configure backend = 'kernel' or 'ce' explicitly")
    if not context.host_pinned:
        return (AutoChoice(direction, "ce", "host memory is not pinned"),
                CeBackend(device, driver))
    smallest = min(p.page_bytes for p in context.gpu_pages)
    if smallest >= LARGE_PAGE_BYTES:
        return (AutoChoice(direction, "ce", f"every GPU page >= {LARGE_PAGE_BYTES >> 20} MiB "
                           f"(smallest {smallest} B): copy engines need no staging"),
                CeBackend(device, driver))

    torch_device = torch.device("cuda", device)
    started = time.perf_counter()
    try:
        scratch = _Scratch(context, torch_device)
        plan = scratch.plan(direction)
        stream = torch.cuda.Stream(device=torch_device)
        rates: list[tuple[str, float, CopyBackend]] = []
        for name, build in _candidates(device, driver):
            backend = build()
            seconds = _time_backend(backend, plan, stream)
            rates.append((name, plan.num_bytes / seconds / 1e9, backend))
    except (RuntimeError, BackendError) as e:
        raise BackendError(f"auto: calibration for {direction.label} failed: {e}") from e
    rates.sort(key=lambda r: -r[1])
    best_name, best_rate, best = rates[0]
    for _, _, other in rates[1:]:
        other.close()
    elapsed_ms = (time.perf_counter() - started) * 1e3
    summary = ", ".join(f"{n} {r:.1f}" for n, r, _ in rates)
    reason = (f"fastest SM-free path at {smallest} B pages: {summary} GB/s "
              f"({scratch.sizes.size} pages, {elapsed_ms:.0f} ms calibration)")
    if best_name == "staged":
        reason += f"; plans of <= {SMALL_PLAN_DESCRIPTORS} descriptors on ce"
    return (AutoChoice(direction, best_name, reason,
                       tuple((n, round(r, 2)) for n, r, _ in rates)), best)


def create(context) -> AutoBackend:
    choice, backend = choose(context)
    log.info("transfer backend %s", choice.describe())
    small = None
    if choice.name == "staged":
        small = CeBackend(device_index(context.device), backend.driver)
    return AutoBackend(backend, choice, small)
