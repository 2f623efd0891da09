"""Page-locking (pinning) host memory for one GPU, per process.

Registration is per process: the coordinator cannot pin for a worker, so each worker
registers its own slice. We use the driver API (``cuMemHostRegister`` through
cuda-bindings, flags 0: on UVA systems the memory is then mapped and portable), which
leaves the CUDA runtime's last-error state alone — a failed ``cudaHostRegister`` would
otherwise resurface later as a bogus error in an unrelated torch call. Chunks are cut
by the caller (``RegionLayout.pin_chunks``: <= 64 GiB, on row boundaries); a failure
unregisters the chunks already registered, in reverse order, and raises: pinned whole
or not at all.
"""

from __future__ import annotations

import logging
import time

from tiercache.errors import PinError, PinUnavailableError

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
    try:
        from cuda.bindings import driver
    except ImportError as e:
        raise PinUnavailableError(
            "cuda-bindings is not installed (pip install 'tiercache[gpu]'); it is needed to "
            "register the region with the CUDA driver"
        ) from e
    return torch, driver


def _check(driver, result, what: str) -> None:
    err = result[0] if isinstance(result, tuple) else result
    if err != driver.CUresult.CUDA_SUCCESS:
        _, name = driver.cuGetErrorName(err)
        raise PinError(f"{what} failed: {name.decode() if isinstance(name, bytes) else name}")


class HostPinner:
    """Owns this process's registrations of host ranges for one device."""

    def __init__(self, device: int = 0):
        self.device = device
        self._registered: list[tuple[int, int]] = []

    @property
    def pinned_bytes(self) -> int:
        return sum(n for _, n in self._registered)

    def pin(self, chunks: list[tuple[int, int]]) -> float:
        """Register every (address, length) chunk; returns seconds. All or nothing."""
        if self._registered:
            raise PinError(f"already pinned {self.pinned_bytes} bytes; unpin() first")
        torch, driver = _driver()
        torch.cuda.set_device(self.device)
        torch.cuda.init()
        torch.empty(1, device=f"cuda:{self.device}")  # makes the primary context current here
        start = time.perf_counter()
        try:
            for address, length in chunks:
                _check(driver, driver.cuMemHostRegister(address, length, 0),
                       f"cuMemHostRegister({address:#x}, {length} bytes) on cuda:{self.device}")
                self._registered.append((address, length))
        except PinError:
            self._rollback(driver)
            raise
        return time.perf_counter() - start

    def _rollback(self, driver) -> None:
        while self._registered:
            address, _ = self._registered.pop()
            result = driver.cuMemHostUnregister(address)
            if result[0] != driver.CUresult.CUDA_SUCCESS:
                log.error("rollback: cuMemHostUnregister(%#x) failed: %s", address, result[0])

    def unpin(self) -> float:
        """Unregister everything this pinner registered (reverse order); returns seconds."""
        if not self._registered:
            return 0.0
        _, driver = _driver()
        start = time.perf_counter()
        errors = []
        while self._registered:
            address, length = self._registered.pop()
            result = driver.cuMemHostUnregister(address)
            if result[0] != driver.CUresult.CUDA_SUCCESS:
                errors.append(f"{address:#x}+{length}: {result[0]}")
        if errors:
            raise PinError(f"cuMemHostUnregister failed for {errors}")
        return time.perf_counter() - start
