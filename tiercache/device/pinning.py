"""Page-locking (pinning) host memory for one GPU, per process.

Registration is per process: the coordinator cannot pin for a worker, so each worker
registers its own slice. We use the driver API (``cuMemHostRegister``, flags 0: on UVA
systems the memory is then mapped and portable) through the package's one CUDA binding,
ctypes over libcuda (``tiercache.device.driver``); the driver API leaves the CUDA
runtime's last-error state alone — a failed ``cudaHostRegister`` would otherwise
resurface later as a bogus error in an unrelated torch call. The ranges are cut by the
caller (``RegionLayout.registrations``: <= 64 GiB, on row boundaries); a failure
unregisters the ranges already registered, in reverse order, and raises: page-locked
whole or not at all.
"""

from __future__ import annotations

import logging
import time

from tiercache.device.driver import CUDA_SUCCESS, CudaDriver
from tiercache.errors import BackendError, PinError, PinUnavailableError
from tiercache.region.progress import Progress

log = logging.getLogger(__name__)


def _driver():
    try:
        import torch
    except ImportError as e:  # pragma: no cover - torch is a dependency
        raise PinUnavailableError("torch is not installed") from e
    if not torch.cuda.is_available():
        raise PinUnavailableError(
            f"no CUDA device visible to this process (torch {torch.__version__}, "
            f"CUDA build {torch.version.cuda}); host memory cannot be pinned here"
        )
    torch.cuda.init()  # the driver initialised before any driver call
    try:
        return torch, CudaDriver()
    except BackendError as e:
        raise PinUnavailableError(f"the CUDA driver cannot be used here: {e}") from e


class HostPinner:
    """Owns this process's registrations of host ranges for one device."""

    def __init__(self, device: int = 0):
        self.device = device
        self._registered: list[tuple[int, int]] = []

    @property
    def pinned_bytes(self) -> int:
        return sum(n for _, n in self._registered)

    def pin(self, ranges: list[tuple[int, int]], progress: Progress | None = None) -> float:
        """Register every (address, length) range, each told to ``progress`` once
        registered; returns seconds. All or nothing for this call: a failure unregisters
        this call's ranges and keeps earlier calls' (a slice is pinned chunk by chunk,
        ``tiercache.region.preparation``). Ranges must not overlap registered ones."""
        torch, driver = _driver()
        torch.cuda.set_device(self.device)
        torch.empty(1, device=f"cuda:{self.device}")  # makes the primary context current here
        start, before = time.perf_counter(), len(self._registered)
        for address, length in ranges:
            rc = driver.mem_host_register(address, length)
            if rc != CUDA_SUCCESS:
                self._rollback(driver, before)
                raise PinError(f"cuMemHostRegister({address:#x}, {length} bytes) on "
                               f"cuda:{self.device} failed: {driver.error_name(rc)}")
            self._registered.append((address, length))
            if progress is not None:
                progress.advance(length)
        return time.perf_counter() - start

    def _rollback(self, driver: CudaDriver, keep: int) -> None:
        while len(self._registered) > keep:
            address, _ = self._registered.pop()
            rc = driver.mem_host_unregister(address)
            if rc != CUDA_SUCCESS:
                log.error("rollback: cuMemHostUnregister(%#x) failed: %s", address,
                          driver.error_name(rc))

    def unpin(self) -> float:
        """Unregister everything this pinner registered (reverse order); returns seconds."""
        if not self._registered:
            return 0.0
        _, driver = _driver()
        start = time.perf_counter()
        errors = []
        while self._registered:
            address, length = self._registered.pop()
            rc = driver.mem_host_unregister(address)
            if rc != CUDA_SUCCESS:
                errors.append(f"{address:#x}+{length}: {driver.error_name(rc)}")
        if errors:
            raise PinError(f"cuMemHostUnregister failed for {errors}")
        return time.perf_counter() - start
