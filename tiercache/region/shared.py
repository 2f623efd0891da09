"""The rank-partitioned shared-memory region in /dev/shm.

Lifecycle: the coordinator ``create``\\ s the region (space checks, O_CREAT|O_EXCL 0600,
fallocate, header written with READY last) and holds an exclusive
``flock`` on it for as long as it lives, so "is the owner alive?" is one non-blocking
lock attempt that the kernel answers correctly even after SIGKILL. Workers ``attach``
by name and rank, validate the header, map the region and pin only their slice. Each worker
pre-faults its own slice in parallel threads (``prefault_slice``) before pinning it:
page tables are per process, so pre-faulting in the coordinator only filled the
coordinator's (measured on an H100 VM, 16 GiB: +3.5-4.4 s, and registration still had
to fault every page; see docs/benchmarks.md). fallocate stays in the coordinator: it is
the reservation that makes READY a promise (no SIGBUS later), paid once per coordinator
lifetime and skipped on re-adoption. A region whose lock is free is stale: ``create``
re-adopts it when its geometry matches (workers' mappings and pins stay valid) and
otherwise replaces it; ``remove_stale``
(``tiercache clean``) unlinks it. Workers never unlink.

Views are made from the mapping's address (not the buffer protocol), so ``close`` never
fails on exported buffers; a view used after ``close`` is a use-after-free, and the
owners (Worker, Coordinator) drop theirs first.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import stat
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np

from tiercache.config import Config, PinningPolicy, format_bytes
from tiercache.errors import (
    LayoutMismatchError, PinError, RegionError, RegionExistsError, RegionNotFoundError,
    RegionNotReadyError,
)
from tiercache.region.header import HeaderInfo, RegionHeader, RegionState
from tiercache.region.hostmem import (
    check_space, fallocate, prefault, process_alive, process_start_ns,
)
from tiercache.region.layout import HEADER_FIXED_BYTES, RegionLayout
from tiercache.region.pinning import HostPinner
from tiercache.region.stats import PinState, RankStats

log = logging.getLogger(__name__)

SHM_DIR = "/dev/shm"
NAME_PREFIX = "tiercache-"
_POLL_S = 0.005
_YOUNG_S = 10.0  # a headerless region younger than this may be mid-creation: clean leaves it


@dataclass(frozen=True)
class SetupTimes:
    """Seconds each step of ``create`` took (printed by ``tiercache serve``)."""

    check_s: float = 0.0
    allocate_s: float = 0.0
    header_prefault_s: float = 0.0
    adopted: bool = False
    replaced_stale: bool = False


def _lock_free(fd: int) -> bool:
    """True if nobody holds the owner lock (we take it and keep it)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


class SharedOffloadRegion:
    """One mapping of a tiercache region: the coordinator's (``create``) or a worker's."""

    def __init__(self, path: str, fd: int, layout: RegionLayout, rank: int | None, owner: bool):
        self.path, self.layout, self.rank, self.is_owner = path, layout, rank, owner
        self._fd = fd
        self._mmap = mmap.mmap(fd, layout.total_bytes, mmap.MAP_SHARED,
                               mmap.PROT_READ | mmap.PROT_WRITE)
        self.base_address = ctypes.addressof(ctypes.c_char.from_buffer(self._mmap))
        self._bytes = np.ctypeslib.as_array(
            (ctypes.c_uint8 * layout.total_bytes).from_address(self.base_address))
        self.header = RegionHeader(self._bytes[:HEADER_FIXED_BYTES])
        self._stats: dict[int, RankStats] = {}
        self._pinner: HostPinner | None = None
        self.setup_times = SetupTimes()

    # ------------------------------------------------------------------ create
    @classmethod
    def create(cls, config: Config, shm_dir: str = SHM_DIR,
               log_step: Callable[[str], None] = log.info) -> SharedOffloadRegion:
        """Create (or re-adopt a stale) region for ``config``; the caller owns it until close."""
        layout = RegionLayout.from_config(config)
        path = os.path.join(shm_dir, config.shm_name)
        t0 = time.perf_counter()
        adopted, replaced = cls._adopt_or_remove_stale(path, layout, log_step)
        if adopted is not None:
            return adopted
        check_space(layout.total_bytes, shm_dir, config.region.check_host_memory)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        except FileExistsError:
            raise RegionExistsError(f"{path} appeared while starting: another coordinator of "
                                    f"name {config.name!r} is starting") from None
        t_check = time.perf_counter()
        region = None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for our whole life: the liveness signal
            os.fchmod(fd, 0o600)
            fallocate(fd, layout.total_bytes, path)
            region = cls(path, fd, layout, rank=None, owner=True)
            region.header.write(layout, generation=1, owner_pid=os.getpid(),
                                owner_start_ns=process_start_ns(os.getpid()),
                                created_ns=time.time_ns())
            t_alloc = time.perf_counter()
            log_step(f"allocated {format_bytes(layout.total_bytes)} at {path} (fallocate) "
                     f"in {t_alloc - t_check:.2f} s")
            prefault_s = prefault(region.base_address, region._bytes,
                                  [(0, layout.header_bytes)], 1)
            log_step(f"pre-faulted the header in {prefault_s:.3f} s; each worker pre-faults "
                     f"its own slice with {config.region.prefault_threads} threads at attach")
            region.header.set_state(RegionState.READY)
        except BaseException:
            if region is not None:
                region._release_mapping()
            os.close(fd)
            os.unlink(path)
            raise
        region.setup_times = SetupTimes(t_check - t0, t_alloc - t_check, prefault_s,
                                        replaced_stale=replaced)
        return region

    @classmethod
    def _adopt_or_remove_stale(cls, path: str, layout: RegionLayout,
                               log_step: Callable[[str], None]
                               ) -> tuple[SharedOffloadRegion | None, bool]:
        """(the re-adopted region or None, whether a stale region of another geometry was
        removed). Raises RegionExistsError if a live coordinator holds ``path``."""
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            return None, False
        if not _lock_free(fd):
            owner = _peek_owner(fd)
            os.close(fd)
            raise RegionExistsError(f"{path} belongs to a live coordinator (pid {owner}); "
                                    "stop it first, or choose another instance.name")
        info = _peek_header(fd)
        if info is None or info.layout_digest != layout.digest or info.state != RegionState.READY:
            why = "no valid header" if info is None else (
                "a different geometry" if info.layout_digest != layout.digest
                else f"state {info.state.label}")
            log_step(f"replacing stale region {path} (owner pid "
                     f"{info.owner_pid if info else '?'} is gone; {why})")
            os.unlink(path)  # while we hold its lock: nobody can have adopted it meanwhile
            os.close(fd)
            return None, True
        try:
            region = cls(path, fd, layout, rank=None, owner=True)
        except BaseException:
            os.close(fd)
            raise
        region.header.set_owner(generation=info.generation + 1, owner_pid=os.getpid(),
                                owner_start_ns=process_start_ns(os.getpid()))
        log_step(f"re-adopted stale region {path} (owner pid {info.owner_pid} is gone; same "
                 f"geometry; generation {info.generation + 1}); its pages stay allocated")
        region.setup_times = SetupTimes(adopted=True)
        return region, False

    # ------------------------------------------------------------------ attach
    @classmethod
    def attach(cls, name: str, rank: int | None = None, *, layout: RegionLayout | None = None,
               timeout_s: float = 0.0, shm_dir: str = SHM_DIR) -> SharedOffloadRegion:
        """Map an existing region; wait up to ``timeout_s`` for it to appear and be READY.

        ``name`` is the instance name (config ``instance.name``) or the full
        ``tiercache-<name>``. With ``layout``, a region of another geometry is refused.
        """
        shm_name = name if name.startswith(NAME_PREFIX) else NAME_PREFIX + name
        path = os.path.join(shm_dir, shm_name)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fd = os.open(path, os.O_RDWR)
                break
            except FileNotFoundError:
                if time.monotonic() >= deadline:
                    raise RegionNotFoundError(f"no region {path} (is `tiercache serve` running "
                                              f"with instance.name = {name!r}?)") from None
                time.sleep(_POLL_S)
        try:
            info = cls._wait_ready(fd, path, deadline)
            if layout is not None and layout.digest != info.layout_digest:
                raise LayoutMismatchError(
                    f"{path} has geometry [{info.layout.describe()}]; this worker expects "
                    f"[{layout.describe()}]")
            if rank is not None:
                info.layout.check_rank(rank)
            return cls(path, fd, info.layout, rank=rank, owner=False)
        except BaseException:
            os.close(fd)
            raise

    @staticmethod
    def _wait_ready(fd: int, path: str, deadline: float) -> HeaderInfo:
        while True:
            info = _peek_header(fd)
            if info is not None and info.state == RegionState.READY:
                return info
            if time.monotonic() >= deadline:
                state = info.state.label if info else "not yet initialised"
                raise RegionNotReadyError(f"{path} is not READY (state: {state})")
            time.sleep(_POLL_S)

    # ------------------------------------------------------------------ views
    def info(self) -> HeaderInfo:
        return self.header.read()

    def owner_alive(self) -> bool:
        info = self.header.read()
        return process_alive(info.owner_pid, info.owner_start_ns)

    def stats(self, rank: int) -> RankStats:
        if rank not in self._stats:
            self._stats[rank] = RankStats(self._bytes, self.layout.stats_offset(rank), rank)
        return self._stats[rank]

    def rank_array(self, rank: int) -> np.ndarray:
        """uint8 ``(num_blocks, row_stride)`` view of ``rank``'s slice."""
        off = self.layout.slice_offset(rank)
        used = self.layout.slice_used_bytes
        return self._bytes[off:off + used].reshape(self.layout.num_blocks, self.layout.row_stride)

    def tensor_views(self, rank: int) -> list:
        """int8 torch views ``(num_blocks, cpu_page_bytes[t])`` with stride ``(row_stride, 1)``."""
        import torch

        base = torch.from_numpy(self.rank_array(rank).reshape(-1)).view(torch.int8)
        return [
            torch.as_strided(base, (self.layout.num_blocks, size), (self.layout.row_stride, 1),
                             offset)
            for size, offset in zip(self.layout.cpu_page_bytes, self.layout.page_offsets)
        ]

    def ledger_array(self) -> np.ndarray:
        """uint8 view of the index ledger (the coordinator's index writes it; see region.ledger)."""
        off = self.layout.ledger_offset
        return self._bytes[off:off + self.layout.ledger_bytes]

    def slice_address(self, rank: int) -> int:
        return self.base_address + self.layout.slice_offset(rank)

    # ------------------------------------------------------------------ preparing
    def prefault_slice(self, num_threads: int) -> float:
        """Pre-fault this worker's slice in its own page tables, ``num_threads`` in parallel
        (MADV_POPULATE_WRITE: a shortage is an InsufficientMemoryError here, never a SIGBUS
        later); returns seconds and records them in the rank's stats block."""
        if self.rank is None:
            raise RegionError("prefault_slice() needs a region attached with a rank")
        ranges = self.layout.prefault_ranges(num_threads, self.layout.slice_offset(self.rank),
                                             self.layout.slice_used_bytes)
        seconds = prefault(self.base_address, self._bytes, ranges, num_threads)
        self.stats(self.rank).set_prefault(seconds)
        return seconds

    # ------------------------------------------------------------------ pinning
    def pin(self, policy: PinningPolicy, device: int = 0) -> PinState:
        """Pin this worker's slice for ``device``; the outcome goes to the rank's stats block.

        Under ``REQUIRED`` a failure raises (state FAILED is exported first); under
        ``ALLOW_UNPINNED`` it is logged loudly and the state UNPINNED is exported.
        """
        if self.rank is None:
            raise PinError("pin() needs a region attached with a rank")
        stats = self.stats(self.rank)
        chunks = [(self.base_address + off, n) for off, n in self.layout.pin_chunks(self.rank)]
        pinner = HostPinner(device)
        try:
            seconds = pinner.pin(chunks)
        except PinError as e:
            if policy is PinningPolicy.REQUIRED:
                stats.set_pin(PinState.FAILED)
                raise
            log.warning("rank %d runs UNPINNED (region.pinning = allow_unpinned): %s", self.rank, e)
            stats.set_pin(PinState.UNPINNED)
            return PinState.UNPINNED
        self._pinner = pinner
        stats.set_pin(PinState.PINNED, pinner.pinned_bytes, seconds)
        log.info("rank %d pinned %s in %.2f s (%d chunk(s))", self.rank,
                 format_bytes(pinner.pinned_bytes), seconds, len(chunks))
        return PinState.PINNED

    @property
    def pinned(self) -> bool:
        return self._pinner is not None

    def unpin(self) -> None:
        if self._pinner is not None:
            pinner, self._pinner = self._pinner, None
            pinner.unpin()

    # ------------------------------------------------------------------ teardown
    def _release_mapping(self) -> None:
        for stats in self._stats.values():
            stats.release()
        self._stats.clear()
        self.header = None  # type: ignore[assignment]
        self._bytes = None  # type: ignore[assignment]
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None

    def close(self, unlink: bool | None = None, unmap: bool = True) -> None:
        """Unpin, unmap and close. The owner unlinks (state CLOSING first) unless told not to.
        ``unmap=False`` keeps the mapping (until the process exits) for when another thread
        may still read it, e.g. a scrape the exporter could not drain."""
        if self._fd < 0:
            return
        unlink = self.is_owner if unlink is None else unlink
        if unlink and not self.is_owner:
            raise RegionError("only the coordinator that owns a region unlinks it")
        try:
            self.unpin()  # a failure is raised, but only after everything below is released
        finally:
            if unlink:
                self.header.set_state(RegionState.CLOSING)
            if unmap:
                self._release_mapping()
            if unlink:
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SharedOffloadRegion:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---------------------------------------------------------------------- inspection
def _peek_header(fd: int) -> HeaderInfo | None:
    """The header of an open region file, or None if it is too short or not (yet) valid."""
    if os.fstat(fd).st_size < HEADER_FIXED_BYTES:
        return None
    with mmap.mmap(fd, HEADER_FIXED_BYTES, mmap.MAP_SHARED, mmap.PROT_READ) as m:
        header = RegionHeader(m)
        if not header.has_magic():
            return None
        try:
            return header.read()
        except LayoutMismatchError:
            return None


def recorded_socket_path(name: str, shm_dir: str = SHM_DIR) -> str | None:
    """The control socket path the coordinator of instance ``name`` recorded in its region
    header, or None (no region, not a regular file, not READY, nothing recorded). Opened
    non-blocking and without following links: a FIFO or symlink in its place is no region."""
    shm_name = name if name.startswith(NAME_PREFIX) else NAME_PREFIX + name
    try:
        fd = os.open(os.path.join(shm_dir, shm_name),
                     os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        info = _peek_header(fd)
    finally:
        os.close(fd)
    if info is None or info.state != RegionState.READY:
        return None
    return info.socket_path or None


def _peek_owner(fd: int) -> int | str:
    info = _peek_header(fd)
    return info.owner_pid if info else "unknown"


@dataclass(frozen=True)
class RegionListing:
    name: str
    path: str
    size_bytes: int
    live: bool
    info: HeaderInfo | None


def list_regions(shm_dir: str = SHM_DIR) -> list[RegionListing]:
    """Every tiercache region in ``shm_dir``, with whether its coordinator is alive."""
    found = []
    for entry in sorted(os.listdir(shm_dir)):
        if not entry.startswith(NAME_PREFIX):
            continue
        path = os.path.join(shm_dir, entry)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            live = not _lock_free(fd)
            found.append(RegionListing(entry[len(NAME_PREFIX):], path, os.fstat(fd).st_size,
                                       live, _peek_header(fd)))
        finally:
            os.close(fd)  # also drops the probe lock we may have taken
    return found


def remove_stale(shm_dir: str = SHM_DIR, dry_run: bool = False, name_prefix: str = ""
                 ) -> list[RegionListing]:
    """Unlink every region (whose name starts with ``name_prefix``) whose coordinator is
    gone; never a live one."""
    removed = []
    for listing in list_regions(shm_dir):
        if listing.live or not listing.name.startswith(name_prefix):
            continue
        if listing.info is None and time.time() - os.stat(listing.path).st_mtime < _YOUNG_S:
            continue
        fd = os.open(listing.path, os.O_RDONLY)
        try:
            if not _lock_free(fd):  # a coordinator took it over meanwhile
                continue
            if not dry_run:
                os.unlink(listing.path)
            removed.append(listing)
        finally:
            os.close(fd)
    return removed
