"""A worker: one rank's region slice, pinned, with both transfer handlers over it.

``attach`` does, in order: map the region by name and rank (waiting up to
``ready_timeout_s`` for READY) and claim one of the rank's attachment slots (one process
per engine may attach the same rank: ``tiercache.region.attachments``), check
``gpu_caches`` against the region's geometry and the backend against the caches' device,
mark the attachment in its own stats block (pid and process start time; counters continue
from the slot's earlier holders), pre-fault and page-lock the slice's first chunk per
``region.pinning`` with its NUMA placement around it (``tiercache.region.placement``; host
caches need no pinning: state UNPINNED), build the backend of each direction (recorded in
the stats block) and the handlers, then leave the rest of the slice to a background thread
that follows the coordinator's reservation (``tiercache.region.preparation``): until it is
done, rows not yet pinned are copied through a page-locked bounce buffer of the worker's
(``tiercache.transfer.gated_path``, ``tiercache.backends.bounce``), and the stats block
says PINNING with the bytes so far.
Anything failing on the way undoes what was done and raises. ``Worker.close`` stops the
preparation, drains the handlers, unregisters the slice, marks the attachment detached,
unmaps and frees the attachment slot.

**Fencing.** Every transfer's CPU spec is checked against the region this worker maps
before a byte moves (``tiercache.transfer.fence``). A spec for another region that is now
the one under the worker's name (the coordinator replaced the region while this worker
was attached) makes the worker re-attach: it attaches the new region (map, pin, handlers)
first, then drains and releases the old one (results of transfers in flight still come
from ``get_finished``), then copies. A spec for any other region fails the transfer.

Transfers enter with their direction in the verb, vLLM 0.33's worker API:
``submit_store(job_id, gpu_spec, cpu_spec)`` and ``submit_load(job_id, cpu_spec,
gpu_spec)``; ``transfer_async(job_id, (src_spec, dst_spec))`` is the generic entry that
reads the direction from the pair once and routes the same way.

Accepted ``gpu_caches`` forms: see ``tiercache.transfer.kv_caches``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from typing import Any

from tiercache.errors import (ArgumentError, EngineDependencyError, PinError,
                              PinUnavailableError)

try:
    import torch
except ModuleNotFoundError as e:  # the package does not depend on torch: the engine brings it
    if e.name != "torch":
        raise
    raise EngineDependencyError.torch_for("tiercache.attach") from e

from tiercache.backends import (
    BackendContext, BackendKind, create_backend, create_stream_platform, resolve_kind,
)
from tiercache.backends.base import CopyBackend
from tiercache.backends.bounce import BounceBackend
from tiercache.device.driver import device_index
from tiercache.device.locality import caches_node
from tiercache.device.pinning import HostPinner
from tiercache.device.streams import StreamPlatform
from tiercache.config import Config, PinningPolicy, RegionConfig
from tiercache.numa.topology import HostTopology
from tiercache.region.attachments import incarnation
from tiercache.region.hostmem import process_start_ns
from tiercache.region.layout import RegionLayout
from tiercache.region.ledger import IndexLedger
from tiercache.region.placement import SlicePlacer
from tiercache.region.preparation import SlicePreparer
from tiercache.region.names import named_region_info
from tiercache.region.shared import SharedOffloadRegion
from tiercache.region.stats import PinState, RankStats
from tiercache.planning.geometry import TransferGeometry
from tiercache.planning.planner import TransferPlanner
from tiercache.specs import (
    CPULoadStoreSpec, Direction, GPULoadStoreSpec, LoadStoreSpec, TransferSpec,
)
from tiercache.transfer.fence import SlotFence
from tiercache.transfer.gated_path import GatedPath
from tiercache.transfer.handlers import CpuGpuOffloadingHandlers, TransferResult
from tiercache.transfer.host_copy import HostCopyPool
from tiercache.transfer.kv_caches import GpuCaches, device_of, page_arrays_of, slice_tensors
from tiercache.transfer.wiring import path_for

log = logging.getLogger(__name__)


class Worker:
    """An attached rank. Drive it from one thread; ``close`` (or ``with``) when done."""

    def __init__(self, region: SharedOffloadRegion, rank: int, handlers: CpuGpuOffloadingHandlers,
                 preparer: SlicePreparer, gpu_caches: Any, reattach: Any = None):
        self.region = region
        self.rank = rank
        self.handlers = handlers
        self.preparer = preparer  # the slice's pre-fault and pinning, in the background
        self._gpu_caches = gpu_caches  # the planner holds addresses: keep the memory alive
        self._reattach = reattach  # () -> Worker over the region now under our name
        self._carried: list[TransferResult] = []  # results of a region we left
        self.reattach_count = 0
        self._closed = False

    @property
    def stats(self) -> RankStats:
        """This attachment's own stats block (its slot's)."""
        return self.region.stats(self.rank)

    @property
    def pin_state(self) -> PinState:
        """PINNING while the slice is page-locked in the background, then PINNED (or what
        a failure left: FAILED, UNPINNED); UNPINNED for host caches. The stats block's."""
        return self.stats.snapshot().pin_state

    @property
    def slot(self) -> int:
        """The attachment slot of the rank this worker holds."""
        assert self.region.slot is not None
        return self.region.slot

    @property
    def incarnation(self) -> int:
        """This attachment's incarnation (``tiercache.region.attachments.incarnation``): what
        ``RankMonitor`` reports for the rank while this worker is up."""
        return incarnation(self.slot, self.stats.snapshot().attach_count)

    @property
    def backends(self) -> dict[Direction, BackendKind]:
        """The kind each direction runs (what its stats block records)."""
        return {d: self.handlers.handler(d).kind for d in Direction}

    def submit_store(self, job_id: int, gpu_spec: GPULoadStoreSpec,
                     cpu_spec: CPULoadStoreSpec) -> bool:
        """Copy ``gpu_spec``'s blocks into ``cpu_spec``'s slots (GPU→CPU). ``SpecError``
        naming the given types when they are not (GPULoadStoreSpec, CPULoadStoreSpec);
        otherwise as ``SingleDirectionOffloadingHandler.transfer_async``."""
        self._follow(cpu_spec)
        return self.handlers.gpu_to_cpu_handler.transfer_async(job_id, (gpu_spec, cpu_spec))

    def submit_load(self, job_id: int, cpu_spec: CPULoadStoreSpec,
                    gpu_spec: GPULoadStoreSpec, expedited: bool = False) -> bool:
        """Copy ``cpu_spec``'s slots into ``gpu_spec``'s blocks (CPU→GPU).

        ``expedited`` marks vLLM 0.33's sync loads, which the engine waits for within the
        step. For now they go through the same load handler as every other load: FIFO
        behind loads already submitted, on the same stream pool. A handler of their own
        (so they never queue behind ordinary loads) is what vLLM's CPU worker does, and
        the place to add it is here.
        """
        self._follow(cpu_spec)
        return self.handlers.cpu_to_gpu_handler.transfer_async(job_id, (cpu_spec, gpu_spec))

    def transfer_async(self, job_id: int, transfer: TransferSpec) -> bool:
        """The generic entry: the direction is read from the pair's types, once."""
        direction = Direction.of(transfer)
        self._follow(direction.src_dst(*transfer)[1])  # (src, dst) back to (GPU, CPU)
        return self.handlers.handler(direction).transfer_async(job_id, transfer)

    def _follow(self, cpu_spec: LoadStoreSpec) -> None:
        """Re-attach when ``cpu_spec`` is for the region now under this worker's name (the
        coordinator replaced ours); a spec of any other region is left to the fence."""
        if not isinstance(cpu_spec, CPULoadStoreSpec) or not cpu_spec.fenced \
                or cpu_spec.region_id == self.region.region_id:
            return  # a spec of the wrong type is the handler's to refuse, naming it
        if self._reattach is None or self._closed:
            return
        current = named_region_info(self.region.path.rsplit("/", 1)[-1])
        if current is None or current.region_id != cpu_spec.region_id:
            return
        log.warning("rank %d: the coordinator replaced region %s (identity %#018x -> %#018x); "
                    "re-attaching", self.rank, self.region.path, self.region.region_id,
                    cpu_spec.region_id)
        try:
            fresh = self._reattach()
        except Exception:  # the transfer is then refused by the fence, and said why
            log.exception("rank %d: re-attaching to the new region failed", self.rank)
            return
        old_region, old_handlers = self.region, self.handlers
        old_preparer = self.preparer
        self.region, self.handlers, self.preparer = fresh.region, fresh.handlers, fresh.preparer
        fresh._closed = True  # its parts are ours now
        self.reattach_count += 1
        try:
            old_preparer.close()
            self._carried += old_handlers.shutdown()
        finally:
            _release(old_region, self.rank)

    def get_finished(self) -> list[TransferResult]:
        carried, self._carried = self._carried, []
        return carried + self.handlers.get_finished()

    def wait(self, job_ids: Iterable[int]) -> None:
        self.handlers.wait(job_ids)

    def close(self) -> list[TransferResult]:
        """Drain (returns the results not yet collected), unregister, detach, unmap."""
        if self._closed:
            return []
        self._closed = True
        carried, self._carried = self._carried, []
        try:
            self.preparer.close()  # before the handlers drain and the slice is unregistered
            return carried + self.handlers.shutdown()
        finally:
            _release(self.region, self.rank)

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _release(region: SharedOffloadRegion, rank: int) -> None:
    try:
        region.unpin()
        region.stats(rank).mark_detached()
    finally:
        region.close()


def _settings(config_or_name: Config | str, backend: BackendKind | str | None,
              pinning: PinningPolicy | None) -> tuple[str, RegionLayout | None, BackendKind,
                                                      PinningPolicy]:
    if isinstance(config_or_name, Config):
        name, layout = config_or_name.shm_name, RegionLayout.from_config(config_or_name)
        kind, policy = config_or_name.backend, config_or_name.region.pinning
    else:
        name, layout, kind, policy = config_or_name, None, BackendKind.AUTO, RegionConfig.pinning
    if backend is not None:
        kind = BackendKind.parse(backend, "backend")
    return name, layout, kind, policy if pinning is None else pinning


def attach(config_or_name: Config | str, rank: int, gpu_caches: GpuCaches, *,
           backend: BackendKind | str | None = None,
           group_tensors: Sequence[Sequence[int]] | None = None,
           pinning: PinningPolicy | None = None,
           device: torch.device | str | None = None,
           ready_timeout_s: float = 0.0,
           prefault_threads: int | None = None) -> Worker:
    """Attach ``rank`` of a region and build its handlers over ``gpu_caches``.

    ``config_or_name``: a Config (geometry checked against the region; backend and
    pinning policy from it) or an instance name (geometry taken from the region,
    backend ``auto``, the config's default pinning policy). ``backend`` and ``pinning``
    override either. ``group_tensors[g]`` lists the region tensors of KV-cache group g
    (default: one group of all). ``device`` is needed only when ``gpu_caches`` holds no
    tensor. ``auto`` over CPU tensors is the ``cpu`` backend. The slice is pre-faulted
    with ``prefault_threads`` threads (default: the config's ``region.prefault_threads``)
    before it is pinned, bound around it to the NUMA node of the caches' device
    (``tiercache.device.locality``; ``region.numa_placement``, default on): the first chunk
    before this returns, the rest in the background (``Worker.preparer``; module docstring).
    """
    name, expected_layout, kind, policy = _settings(config_or_name, backend, pinning)
    zero_copy = (config_or_name.zero_copy_bytes if isinstance(config_or_name, Config)
                 else Config.zero_copy_bytes)
    region_config = (config_or_name.region if isinstance(config_or_name, Config)
                     else RegionConfig())
    if prefault_threads is None:
        prefault_threads = region_config.prefault_threads
    numa_placement = region_config.numa_placement
    with ExitStack() as undo:  # each step registers its undo; success keeps them all
        region = SharedOffloadRegion.attach(name, rank, layout=expected_layout,
                                            timeout_s=ready_timeout_s)
        undo.callback(region.close)
        layout = region.layout
        gpu_pages = page_arrays_of(gpu_caches, layout.page_bytes)
        cpu_pages = page_arrays_of(slice_tensors(region, rank), layout.page_bytes,
                                   layout.block_size_factor)
        torch_device = _device(gpu_caches, device)
        kind = resolve_kind(kind, torch_device.type)
        geometry = TransferGeometry.of(gpu_pages, cpu_pages, layout.block_size_factor,
                                       group_tensors)
        planner = TransferPlanner.of(geometry)

        stats = region.stats(rank)
        stats.mark_attached(os.getpid(), process_start_ns(os.getpid()))
        pin_failed = False

        def detach() -> None:
            stats.mark_detached()
            if pin_failed:  # nobody attached; the last attempt could not pin
                stats.set_pin(PinState.FAILED)

        undo.callback(detach)
        undo.callback(region.unpin)
        node = caches_node(torch_device, gpu_pages[0].base_address, HostTopology.read())
        # bound before the pre-fault, counted (and moved) after: NUMA trouble never raises
        # (stats block: tiercache.region.placement)
        try:  # a pre-fault failing leaves the pin state as it was
            preparer = _preparer(region, rank, policy, torch_device, prefault_threads,
                                 region.placer(node, numa_placement))
            undo.callback(preparer.close)
            preparer.first_chunk()  # a registration failing here raises under REQUIRED
        except PinError:
            pin_failed = True
            raise
        if torch_device.type == "cpu":
            stats.set_pin(PinState.UNPINNED)
        streams = create_stream_platform(kind, torch_device)
        undo.callback(streams.close)
        fence = SlotFence(region.region_id, IndexLedger(region.ledger_array()).table)
        handlers = _handlers(kind, geometry, planner, torch_device, preparer, streams,
                             zero_copy, stats, fence)
        preparer.start()  # the rest of the slice in the background
        undo.pop_all()
    log.info("rank %d attached to %s: backends %s, %s", rank, region.path,
             {d.label: handlers.handler(d).kind.label for d in Direction},
             "pinning the slice in the background" if preparer.pinned_ok and
             not preparer.complete else stats.snapshot().pin_state.label)

    def reattach() -> Worker:
        return attach(config_or_name, rank, gpu_caches, backend=backend,
                      group_tensors=group_tensors, pinning=pinning, device=device,
                      ready_timeout_s=0.0, prefault_threads=prefault_threads)

    return Worker(region, rank, handlers, preparer, gpu_caches, reattach)


def _preparer(region: SharedOffloadRegion, rank: int, policy: PinningPolicy,
              device: torch.device, threads: int, placer: SlicePlacer | None) -> SlicePreparer:
    """The slice's preparation (``tiercache.region.preparation``), page-locking for the
    caches' GPU. Host caches cannot use pinned memory: REQUIRED refuses them (raises),
    ALLOW_UNPINNED runs with state UNPINNED exported and the slice only pre-faulted."""
    if device.type != "cpu":
        index = torch.cuda.current_device() if device.index is None else device.index
        return SlicePreparer(region, threads, HostPinner(index), policy, placer)
    _refuse_host_caches(region, rank, policy)
    return SlicePreparer(region, threads, None, policy, placer)


def _handlers(kind: BackendKind, geometry: TransferGeometry, planner: TransferPlanner,
              device: torch.device, preparer: SlicePreparer, streams: StreamPlatform,
              zero_copy: int, stats: RankStats, fence: SlotFence) -> CpuGpuOffloadingHandlers:
    """Both handlers over the chosen backends (recorded in the stats block); while the slice
    is still being page-locked, gated with copies through a page-locked bounce buffer
    (``tiercache.transfer.gated_path``, ``tiercache.backends.bounce``)."""
    backends = _backends(kind, geometry, device, preparer.pinned_ok, streams, zero_copy)
    for direction, chosen in backends.items():
        stats.set_backend(direction, chosen.kind)
    paths = {d: path_for(d, backends[d], planner, streams, fence) for d in Direction}
    if preparer.pinned_ok and not preparer.complete:
        try:
            unpinned = _bounce_backends(device)
        except BaseException:
            for path in paths.values():
                path.close()
            raise
        paths = {d: GatedPath(paths[d], path_for(d, unpinned[d], planner, streams, fence),
                              preparer.pinned) for d in Direction}
    return CpuGpuOffloadingHandlers.of_paths(paths, streams, stats)


def _bounce_backends(device: torch.device) -> dict[Direction, CopyBackend]:
    """Per direction, a ``BounceBackend`` with its own host copy pool (a load may pass a
    store): the path of transfers while the slice is not yet page-locked."""
    built: dict[Direction, CopyBackend] = {}
    try:
        for direction in Direction:
            pool = HostCopyPool()
            try:
                built[direction] = BounceBackend(device_index(device), pool)
            except BaseException:
                pool.close()
                raise
    except BaseException:
        for made in built.values():
            made.close()
        raise
    return built


def _refuse_host_caches(region: SharedOffloadRegion, rank: int, policy: PinningPolicy) -> None:
    """Host caches have no GPU to pin for: raise under REQUIRED (state UNPINNED is set once
    the first chunk is pre-faulted otherwise)."""
    if policy is PinningPolicy.REQUIRED:
        region.stats(rank).set_pin(PinState.FAILED)
        raise PinUnavailableError(
            f"rank {rank}: the caches are host tensors, so there is no GPU to pin the slice "
            "for; region.pinning = 'required' refuses to run unpinned (use GPU caches, or "
            "region.pinning = 'allow_unpinned' on CPU-only hosts)")


def _backends(kind: BackendKind, geometry: TransferGeometry, device: torch.device,
              host_registered: bool, streams: StreamPlatform, zero_copy_bytes: int
              ) -> dict[Direction, CopyBackend]:
    built: dict[Direction, CopyBackend] = {}
    try:
        for direction in Direction:
            context = BackendContext(direction, geometry.gpu_pages, geometry.cpu_pages, device,
                                     host_registered, streams, geometry, zero_copy_bytes)
            built[direction] = create_backend(kind, context)
    except BaseException:
        for made in built.values():
            made.close()
        raise
    return built


def _device(gpu_caches: GpuCaches, device: torch.device | str | None) -> torch.device:
    found = device_of(gpu_caches)
    if device is not None:
        wanted = torch.device(device)
        if found is not None and found.type != wanted.type:
            raise ArgumentError(f"device={wanted} but gpu_caches are on {found}")
        return found or wanted
    if found is None:
        raise ArgumentError("gpu_caches holds only PageArrays: pass device= "
                                  "('cuda:N', or 'cpu' for host memory)")
    return found
