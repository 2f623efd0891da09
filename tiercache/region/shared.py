"""The rank-partitioned shared-memory region in /dev/shm: one process's mapping of it.

Lifecycle: the coordinator ``create``\\ s the region (space checks, a new 0600 object, the
header reserved and written, READY last; the slices reserved after, ``reserver``) and holds
its owner lock for life (``tiercache.region.shm``). Workers ``attach`` by name and rank,
validate the header, claim one of the rank's attachment slots (``region.attachments``:
one per engine), map the region and page-lock only their slice (``pin``, with the worker's
registrar). Workers never unlink. Finding a region by name unmapped: ``region.names``.

Decisions and their reasons:

* Each worker pre-faults its own slice in parallel threads before page-locking it: page
  tables are per process, so pre-faulting in the coordinator would fill only the
  coordinator's, and registration would still fault every page in the worker
  (measurements: docs/benchmarks.md, "Region set-up and pinning"). It does so chunk by
  chunk, each chunk only once it is reserved, in the background for a GPU worker
  (``tiercache.region.preparation``; ``prefault_slice`` in the caller for host-only ones).
* ``posix_fallocate`` stays in the coordinator: it is the reservation that keeps a full
  /dev/shm from being a SIGBUS. ``create`` reserves the header only and is READY at once;
  the slices are reserved in the background, in slot order, and the index hands out only
  reserved slots (``reserver``, ``tiercache.region.reservation``). It allocates every
  page, so the slices' NUMA binding comes first, on the sparse file (``region.placement``).
* A region whose owner lock is free is stale (``tiercache.region.claim`` takes its name
  over). ``create`` re-adopts it when it is ours (regular file, our uid, mode 0600) and
  its geometry matches and it was READY and it is as long as its header says (workers'
  mappings and registrations stay valid, the pages stay allocated, a partly reserved one
  is reserved on); it replaces it when it is ours but of another geometry or state, or cut
  short (``truncation``: unusable, and stale, so nobody maps it); it refuses anything
  else. ``attach`` refuses a truncated region (``RegionTruncatedError``). Stale regions
  are listed and removed by ``tiercache.region.stale``.
* Views are made from the mapping's address (not the buffer protocol), so ``close`` never
  fails on exported buffers; owners (Worker, Coordinator) drop theirs before ``close``.
"""

from __future__ import annotations

import ctypes
import fcntl
import logging
import mmap
import os
import time
from contextlib import ExitStack
from dataclasses import dataclass
from collections.abc import Callable
from typing import Any

import numpy as np

from tiercache.config import Config, PinningPolicy
from tiercache.errors import (
    LayoutMismatchError, PinError, RegionError, RegionExistsError, RegionNotFoundError,
    RegionNotReadyError,
)
from tiercache.numa.topology import HostTopology, NodeChoice
from tiercache.region.progress import Progress
from tiercache.region.attachments import SlotLock, slot_held
from tiercache.region.claim import claim_stale
from tiercache.region.header import (HeaderInfo, RegionHeader, RegionState, Reservation,
                                     new_region_id)
from tiercache.region.hostmem import (check_space, fallocate, prefault, process_alive,
                                      process_start_ns)
from tiercache.region.layout import HEADER_FIXED_BYTES, RegionLayout
from tiercache.region.names import named_region_info, recorded_socket_path, region_shm_name
from tiercache.region.placement import SlicePlacer, bind_rank_slices
from tiercache.region.preparation import SlicePreparer
from tiercache.region.reservation import SliceReserver
from tiercache.region.registrar import HostRegistrar, failed_pin_state
from tiercache.region.shm import (
    NAME_PREFIX, SHM_DIR, OpenEntry, check_size, check_trusted, create_entry, header_refusal,
    open_entry, read_header, still_named, truncation, unlink_if_same,
)
from tiercache.region.stats import PinState, RankStats
from tiercache.sizes import format_bytes


# named_region_info, recorded_socket_path: re-exported (tiercache.region.names holds them)
__all__ = ["HostRegistrar", "SetupTimes", "SharedOffloadRegion", "named_region_info",
           "new_region_id", "recorded_socket_path", "region_shm_name"]

log = logging.getLogger(__name__)

_POLL_S = 0.005


@dataclass(frozen=True)
class SetupTimes:
    """Seconds each step of ``create`` took (printed by ``tiercache serve``)."""

    check_s: float = 0.0
    allocate_s: float = 0.0
    header_prefault_s: float = 0.0
    adopted: bool = False
    replaced_stale: bool = False


class SharedOffloadRegion:
    """One mapping of a tiercache region: the coordinator's (``create``) or a worker's."""

    def __init__(self, entry: OpenEntry, layout: RegionLayout, rank: int | None, owner: bool):
        self.path, self.layout, self.rank, self.is_owner = entry.path, layout, rank, owner
        self._entry = entry
        self._fd = entry.fd
        mapping = mmap.mmap(entry.fd, layout.total_bytes, mmap.MAP_SHARED,
                            mmap.PROT_READ | mmap.PROT_WRITE)
        self._mmap: mmap.mmap | None = mapping  # None once unmapped
        self.base_address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        self._bytes = np.ctypeslib.as_array(
            (ctypes.c_uint8 * layout.total_bytes).from_address(self.base_address))
        self.header = RegionHeader(self._bytes[:HEADER_FIXED_BYTES].data)
        self._region_id = 0  # read once the header is written (create) or checked (attach)
        self._stats: dict[tuple[int, int], RankStats] = {}
        self._slot_lock: SlotLock | None = None  # the attachment slot of a worker's mapping
        self._pinner: HostRegistrar | None = None
        self.setup_times = SetupTimes()

    # ------------------------------------------------------------------ create
    @classmethod
    def create(cls, config: Config, log_step: Callable[[str], None] = log.info,
               topology: HostTopology | None = None, *,
               reserve_now: bool = True) -> SharedOffloadRegion:
        """Create (or re-adopt a stale) region for ``config``; the caller owns it until close.
        With ``region.numa_placement``, each rank's slice is bound to its node before the
        pages are allocated (``tiercache.region.placement``; ``topology``: the host's,
        read from /sys unless given). ``reserve_now``: the slices are reserved before this
        returns; ``serve`` passes False and runs ``reserver`` in the background (workers
        prepare only reserved rows: ``tiercache.region.preparation``).

        Raises ``RegionExistsError`` over a live coordinator, ``RegionTrustError`` over
        what is not ours, ``InsufficientMemoryError`` when /dev/shm or RAM is too small."""
        layout = RegionLayout.from_config(config)
        t0 = time.perf_counter()
        stale = claim_stale(config.shm_name)
        replaced = False
        if stale is not None:
            info = read_header(stale.fd)
            cut = truncation(stale.fd, info)
            if cut is None and info is not None and info.layout_digest == layout.digest and \
                    info.state == RegionState.READY:
                return cls._adopt(stale, layout, info, log_step)._reserved(reserve_now, log_step)
            why = cut or (header_refusal(stale.fd) if info is None else (
                "a different geometry" if info.layout_digest != layout.digest
                else f"state {info.state.label}"))
            log_step(f"replacing stale region {stale.path} (owner pid "
                     f"{info.owner_pid if info else '?'} is gone; {why})")
            unlink_if_same(stale)  # while we hold its lock: nobody can have adopted it
            stale.close()
            replaced = True
        check_space(layout.total_bytes, SHM_DIR, config.region.check_host_memory)
        try:
            entry = create_entry(config.shm_name)
        except RegionExistsError as e:
            raise RegionExistsError(f"{e}: it appeared while this coordinator started; "
                                    f"another coordinator of name {config.name!r} is "
                                    "starting") from None
        t_check = time.perf_counter()
        with ExitStack() as undo:
            undo.callback(entry.close)
            undo.callback(unlink_if_same, entry)
            fcntl.flock(entry.fd, fcntl.LOCK_EX)  # held for our whole life: the liveness signal
            if not still_named(entry):
                raise RegionExistsError(f"{entry.path} was replaced while this coordinator "
                                        f"started: another coordinator of name {config.name!r} "
                                        "is starting")
            os.ftruncate(entry.fd, layout.total_bytes)  # sparse: mapped to bind, no page yet
            region = cls(entry, layout, rank=None, owner=True)
            undo.callback(region._release_mapping)
            if config.region.numa_placement:  # before fallocate allocates the pages
                nodes = (topology or HostTopology.read()).rank_nodes(layout.world_size)
                for line in bind_rank_slices(region.base_address, layout, nodes):
                    log_step(line)
            fallocate(entry.fd, layout.header_bytes, entry.path)  # the slices: ``reserver``
            region.header.write(layout, generation=1, owner_pid=os.getpid(),
                                owner_start_ns=process_start_ns(os.getpid()),
                                created_ns=time.time_ns(), region_id=new_region_id())
            region.header.set_reservation(Reservation.RESERVING, 0)
            region._region_id = region.header.read().region_id
            t_alloc = time.perf_counter()
            log_step(f"allocated the {format_bytes(layout.header_bytes)} header at {entry.path} "
                     f"(fallocate) in {t_alloc - t_check:.2f} s; the "
                     f"{format_bytes(layout.total_bytes - layout.header_bytes)} of slices are "
                     "reserved in the background")
            prefault_s = prefault(region.base_address, region._bytes,
                                  [(0, layout.header_bytes)], 1)
            log_step(f"pre-faulted the header in {prefault_s:.3f} s; each worker pre-faults "
                     f"and pins its own slice ({config.region.prefault_threads} threads) in the "
                     "background, behind the reservation")
            region.header.set_state(RegionState.READY)
            undo.pop_all()
        region.setup_times = SetupTimes(t_check - t0, t_alloc - t_check, prefault_s,
                                        replaced_stale=replaced)
        return region._reserved(reserve_now, log_step)

    def _reserved(self, now: bool, log_step: Callable[[str], None]) -> SharedOffloadRegion:
        """``self``, its slices reserved in the caller when ``now`` (``create``)."""
        reserver = self.reserver(lambda rows: None, log_step) if now else None
        if reserver is not None:
            try:
                reserver.run()
            except BaseException:
                self.close()
                raise
            if reserver.error is not None:
                self.close()
                raise RegionError(f"reserving {self.path} failed: {reserver.error}")
        return self

    @classmethod
    def _adopt(cls, entry: OpenEntry, layout: RegionLayout, info: HeaderInfo,
               log_step: Callable[[str], None]) -> SharedOffloadRegion:
        try:
            region = cls(entry, layout, rank=None, owner=True)
        except BaseException:
            entry.close()
            raise
        region.header.set_owner(generation=info.generation + 1, owner_pid=os.getpid(),
                                owner_start_ns=process_start_ns(os.getpid()))
        region._region_id = info.region_id
        log_step(f"re-adopted stale region {entry.path} (owner pid {info.owner_pid} is gone; "
                 f"same geometry; generation {info.generation + 1}); its pages stay allocated; "
                 f"{info.reserved_rows} of {layout.num_blocks} blocks reserved")
        region.setup_times = SetupTimes(adopted=True)
        return region

    # ------------------------------------------------------------------ attach
    @classmethod
    def attach(cls, name: str, rank: int | None = None, *, layout: RegionLayout | None = None,
               timeout_s: float = 0.0) -> SharedOffloadRegion:
        """Map an existing region; wait up to ``timeout_s`` for it to appear and be READY.

        ``name`` is the instance name (config ``instance.name``) or the full
        ``tiercache-<name>``. With ``layout``, a region of another geometry is refused. A
        region that is not ours with mode 0600 is refused (``RegionTrustError``): a worker
        never writes KV data into a file someone else can read.
        """
        shm_name = region_shm_name(name)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                entry = open_entry(shm_name, writable=True)
                break
            except RegionNotFoundError as e:
                if time.monotonic() >= deadline:
                    instance = shm_name.removeprefix(NAME_PREFIX)  # what the config says
                    raise RegionNotFoundError(f"{e} (is `tiercache serve` running with "
                                              f"instance.name = {instance!r}?)") from None
                time.sleep(_POLL_S)
        try:
            check_trusted(entry)
            info = cls._wait_ready(entry, deadline)
            if layout is not None and layout.digest != info.layout_digest:
                raise LayoutMismatchError(
                    f"{entry.path} has geometry [{info.layout.describe()}]; this worker expects "
                    f"[{layout.describe()}]")
            slot_lock = None if rank is None else SlotLock(entry.fd, info.layout, rank)
            try:
                region = cls(entry, info.layout, rank=rank, owner=False)
            except BaseException:
                if slot_lock is not None:
                    slot_lock.release()
                raise
            region._slot_lock = slot_lock
            region._region_id = info.region_id
            return region
        except BaseException:
            entry.close()
            raise

    @staticmethod
    def _wait_ready(entry: OpenEntry, deadline: float) -> HeaderInfo:
        while True:
            info = read_header(entry.fd)
            check_size(entry, info)  # before anything maps it
            if info is not None and info.state == RegionState.READY:
                return info
            if time.monotonic() >= deadline:
                state = info.state.label if info else "not yet initialised"
                raise RegionNotReadyError(f"{entry.path} is not READY (state: {state})")
            time.sleep(_POLL_S)

    # ------------------------------------------------------------------ views
    @property
    def slot(self) -> int | None:
        """The attachment slot this mapping holds for its rank (a worker's), else None."""
        return None if self._slot_lock is None else self._slot_lock.slot

    def slot_held(self, rank: int, slot: int) -> bool:
        """True while any process holds ``rank``'s attachment ``slot`` (this mapping's own
        included: it holds its slot on a descriptor of its own)."""
        if self._fd < 0:  # closed, the mapping kept for a last scrape: no file to ask
            return False
        return slot_held(self._fd, self.layout, rank, slot)

    def info(self) -> HeaderInfo:
        return self.header.read()

    def live_attachments(self) -> int:
        """How many attachment slots, over every rank, a live process holds (other than
        this mapping's own)."""
        layout = self.layout
        return sum(self.slot_held(rank, slot) for rank in range(layout.world_size)
                   for slot in range(layout.attachments_per_rank))

    def owner_alive(self) -> bool:
        info = self.header.read()
        return process_alive(info.owner_pid, info.owner_start_ns)

    def stats(self, rank: int, slot: int | None = None) -> RankStats:
        """The stats block of ``rank``'s attachment ``slot``; by default the slot this
        mapping holds for its rank, else slot 0."""
        if slot is None:
            slot = self.slot if rank == self.rank and self.slot is not None else 0
        if (rank, slot) not in self._stats:
            self._stats[rank, slot] = RankStats(self._bytes, self.layout.stats_offset(rank, slot),
                                                rank)
        return self._stats[rank, slot]

    def rank_array(self, rank: int) -> np.ndarray:
        """uint8 ``(num_blocks, row_stride)`` view of ``rank``'s slice."""
        off = self.layout.slice_offset(rank)
        used = self.layout.slice_used_bytes
        return self._bytes[off:off + used].reshape(self.layout.num_blocks, self.layout.row_stride)

    def ledger_array(self) -> np.ndarray:
        """uint8 view of the index ledger (the coordinator's index writes it; see region.ledger)."""
        off = self.layout.ledger_offset
        return self._bytes[off:off + self.layout.ledger_bytes]

    def sessions_array(self) -> np.ndarray:
        """uint8 view of the session table (the control server writes it; region.sessions)."""
        off = self.layout.sessions_offset
        return self._bytes[off:off + self.layout.sessions_bytes]

    @property
    def region_id(self) -> int:
        """This region's identity (header ``region_id``): what fenced specs must carry."""
        return self._region_id

    def reserver(self, on_reserved: Callable[[int], None], say: Callable[[str], None] = log.info,
                 **options: Any) -> SliceReserver | None:
        """The owner's background reservation of the rows not reserved yet (None: none);
        ``options``: ``SliceReserver``'s keywords."""
        info = self.header.read()
        return None if info.reservation == Reservation.COMPLETE else SliceReserver(
            self._fd, self.path, self.header, self.layout, info.reserved_rows, on_reserved, say,
            **options)

    # ------------------------------------------------------------------ preparing
    def prefault_slice(self, num_threads: int, node: NodeChoice | None = None,
                       numa_placement: bool = True,
                       log_step: Callable[[str], None] = log.info) -> float:
        """Pre-fault this worker's slice in its own page tables, ``num_threads`` in parallel
        (MADV_POPULATE_WRITE: a shortage is an InsufficientMemoryError here, never a SIGBUS
        later); returns seconds and records them in the rank's stats block. Given the
        ``node`` of the worker's device, the slice is bound to it first and its pages are
        counted (and moved there, with ``numa_placement``) after: the stats block records
        the ``NumaPlacement`` (``tiercache.region.placement``). A long pre-fault reports
        its progress to ``log_step`` (``tiercache.region.progress``)."""
        if self.rank is None:
            raise RegionError("prefault_slice() needs a region attached with a rank")
        preparer = SlicePreparer(self, num_threads, placer=self.placer(node, numa_placement),
                                 say=log_step)
        preparer.run()
        return preparer.prefault_s

    def placer(self, node: NodeChoice | None, numa_placement: bool) -> SlicePlacer | None:
        """The NUMA placement of this worker's slice for the ``node`` of its device (None:
        no node known), ``tiercache.region.placement``."""
        if node is None or self.rank is None:
            return None
        layout = self.layout
        return SlicePlacer(self.base_address + layout.slice_offset(self.rank),
                           layout.slice_bytes, layout.slice_used_bytes, node, numa_placement,
                           self.rank)

    def prefault_rows(self, first: int, end: int, num_threads: int) -> float:
        """Pre-fault rows ``[first, end)`` of this worker's slice in its page tables,
        ``num_threads`` in parallel; returns seconds. Only reserved rows
        (``tiercache.region.preparation`` waits for them)."""
        assert self.rank is not None
        layout = self.layout
        offset = layout.slice_offset(self.rank) + first * layout.row_stride
        ranges = layout.prefault_ranges(num_threads, offset, (end - first) * layout.row_stride)
        return prefault(self.base_address, self._bytes, ranges, num_threads)

    def adopt_registrar(self, registrar: HostRegistrar) -> None:
        """``registrar`` holds registrations of this mapping: ``unpin`` undoes them."""
        self._pinner = registrar

    # ------------------------------------------------------------------ pinning
    def pin(self, policy: PinningPolicy, pinner: HostRegistrar,
            log_step: Callable[[str], None] = log.info) -> PinState:
        """Page-lock this worker's slice with ``pinner`` (the worker's: registration is per
        process and per device, ``tiercache.device.pinning.HostPinner``); the outcome goes
        to the rank's stats block, a long pin's progress to ``log_step``.

        Under ``REQUIRED`` a failure raises (state FAILED is exported first); under
        ``ALLOW_UNPINNED`` it is logged loudly and the state UNPINNED is exported.
        """
        if self.rank is None:
            raise PinError("pin() needs a region attached with a rank")
        stats = self.stats(self.rank)
        ranges = [(self.base_address + off, n)
                  for off, n in self.layout.registrations(self.rank)]
        try:
            with Progress(f"rank {self.rank} pinning", sum(n for _, n in ranges), log_step) as p:
                seconds = pinner.pin(ranges, p)
        except PinError as e:
            state = failed_pin_state(policy, stats, raise_error=e)  # raises under REQUIRED
            log.warning("rank %d runs UNPINNED (region.pinning = allow_unpinned): %s", self.rank, e)
            stats.set_pin(state)
            return state
        self._pinner = pinner
        stats.set_pin(PinState.PINNED, pinner.pinned_bytes, seconds)
        log_step(f"rank {self.rank} page-locked {format_bytes(pinner.pinned_bytes)} in "
                 f"{seconds:.2f} s ({len(ranges)} registration(s))")
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
        # unmapped: a later use fails loudly, never reads freed memory
        self.header = None  # type: ignore[assignment]  # (the line above)
        self._bytes = None  # type: ignore[assignment]  # (the line above)
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
                unlink_if_same(self._entry)  # we hold its lock: it is still ours
            if self._slot_lock is not None:
                self._slot_lock.release()
                self._slot_lock = None
            self._entry.close()
            self._fd = -1

    def __enter__(self) -> SharedOffloadRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
