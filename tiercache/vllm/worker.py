"""``TierCacheWorker``: vLLM's ``OffloadingWorker`` for one rank, over a tiercache ``Worker``.

vLLM hands each rank its KV cache as ``CanonicalKVCaches``: unique int8 tensors of shape
``(num_blocks, page_size_bytes)`` (with vLLM's default per-layer layout one tensor per
layer, stride ``(block stride, 1)`` over the live GPU KV), and per KV-cache group the
tensors that group uses with their un-padded page sizes. Those tensors are exactly the
region's tensors of this rank: tensor t's page is the un-padded page of the layers that
use it, a CPU block (one chunk) is ``blocks_per_chunk`` GPU pages per tensor, and the
groups tell the planner which tensors a group's blocks cover. The geometry is checked
against the region before attaching (one error naming both sides).

The rank attaches with ``tiercache.attach`` (map, pre-fault and pin its own slice, build
both handlers); stats, liveness and pin state appear per rank in the region header.

Failed transfers: vLLM 0.33 has no failure path (its worker asserts every result is a
success). A failed store reported as a success would publish garbage to every engine; a
failed load reported as a success would compute on garbage. So a failure is never
reported as a success: ``get_finished`` raises ``TransferFailedError`` naming the job,
its direction and size, and the engine stops with that message (the job's WRITING slots
are freed and its pins dropped when the engine's sessions end). Never a silently wrong
block.
"""

from __future__ import annotations

import logging

import numpy as np
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec as VllmGPUSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult as VllmTransferResult,
)

from tiercache.config import Config
from tiercache.errors import LayoutMismatchError, SpecError, TransferFailedError
from tiercache.region.shared import SharedOffloadRegion
from tiercache.specs import CPULoadStoreSpec, GPULoadStoreSpec
from tiercache.transfer.worker import Worker, attach
from tiercache.vllm.geometry import EngineGeometry
from tiercache.vllm.load_store_spec import TierCacheLoadStoreSpec

log = logging.getLogger(__name__)


def canonical_geometry(kv_caches: CanonicalKVCaches, *, world_size: int, blocks_per_chunk: int,
                       block_tokens: int) -> tuple[EngineGeometry, list[list[int]]]:
    """The region geometry these caches need, and each group's tensors."""
    unpadded: dict[int, int] = {}
    for refs in kv_caches.group_data_refs:
        for ref in refs:
            seen = unpadded.setdefault(ref.tensor_idx, ref.page_size_bytes)
            if seen != ref.page_size_bytes:
                raise LayoutMismatchError(
                    f"KV tensor {ref.tensor_idx} is used with page sizes {seen} and "
                    f"{ref.page_size_bytes}; tiercache needs one page size per tensor")
    pages = tuple(unpadded.get(t, c.page_size_bytes) for t, c in enumerate(kv_caches.tensors))
    groups = [sorted({ref.tensor_idx for ref in refs}) for refs in kv_caches.group_data_refs]
    geometry = EngineGeometry(world_size=world_size, block_size_factor=blocks_per_chunk,
                              block_tokens=block_tokens, page_bytes=pages)
    return geometry, groups


class TierCacheWorker(OffloadingWorker):
    """See the module docstring. Built by ``TierCacheOffloadingSpec.get_worker``."""

    def __init__(self, worker: Worker):
        self._worker = worker
        self._directions: dict[int, str] = {}  # job id -> "store" / "load", until finished

    @classmethod
    def attach(cls, target: Config | str, rank: int, kv_caches: CanonicalKVCaches,
               geometry: EngineGeometry, group_tensors: list[list[int]],
               ready_timeout_s: float = 0.0) -> TierCacheWorker:
        name = target.name if isinstance(target, Config) else target
        with SharedOffloadRegion.attach(name, timeout_s=ready_timeout_s) as region:
            geometry.check(region.layout, f"{region.path} (rank {rank})",
                           target if isinstance(target, Config) else None)
        caches = [t.tensor for t in kv_caches.tensors]
        worker = attach(target, rank, caches, group_tensors=group_tensors,
                        ready_timeout_s=ready_timeout_s)
        log.info("tiercache: vLLM rank %d attached to %s (%d KV tensors, backends %s)", rank,
                 name, len(caches), {d.label: b.label for d, b in worker.backends.items()})
        return cls(worker)

    @property
    def worker(self) -> Worker:
        return self._worker

    @property
    def jobs_in_flight(self) -> set[int]:
        """Jobs submitted and not yet reported by ``get_finished``."""
        return set(self._directions)

    # ------------------------------------------------------------------ submitting
    def submit_store(self, job_id: int, src_spec: VllmGPUSpec, dst_spec: LoadStoreSpec) -> bool:
        """A refused submission still yields a failed result, which ``get_finished`` raises;
        vLLM asserts this returns True."""
        cpu = _slots(dst_spec, job_id)
        self._directions[job_id] = "store"
        self._worker.submit_store(job_id, _gpu(src_spec), cpu)
        return True

    def submit_load(self, job_id: int, src_spec: LoadStoreSpec, dst_spec: VllmGPUSpec,
                    expedited: bool = False) -> bool:
        """``expedited`` (vLLM's sync loads, waited on within the step) rides the same FIFO
        load handler until the transfer Worker grows a separate expedited queue."""
        cpu = _slots(src_spec, job_id)
        self._directions[job_id] = "load"
        self._worker.submit_load(job_id, cpu, _gpu(dst_spec), expedited=expedited)
        return True

    # ------------------------------------------------------------------ completing
    def get_finished(self) -> list[VllmTransferResult]:
        finished = []
        for result in self._worker.get_finished():
            direction = self._directions.pop(result.job_id, "transfer")
            if not result.success:
                raise TransferFailedError(
                    f"{direction} job {result.job_id} ({result.transfer_size} bytes, "
                    f"{result.transfer_type.label}) failed on rank {self._worker.rank}; vLLM "
                    "cannot recover a failed KV transfer, so the engine stops rather than use "
                    "a wrong block (see the worker's log for the cause)")
            finished.append(VllmTransferResult(result.job_id, True, result.transfer_size,
                                               result.transfer_time))
        return finished

    def wait(self, job_ids: set[int]) -> None:
        self._worker.wait(job_ids)

    def shutdown(self) -> None:
        self._worker.close()
        self._directions.clear()


def _gpu(spec: VllmGPUSpec) -> GPULoadStoreSpec:
    return GPULoadStoreSpec(np.asarray(spec.block_ids), spec.group_sizes, spec.block_indices)


def _slots(spec: LoadStoreSpec, job_id: int) -> CPULoadStoreSpec:
    if not isinstance(spec, TierCacheLoadStoreSpec):
        raise SpecError(f"job {job_id}: a {type(spec).__name__} reached the tiercache worker; "
                        "only TierCacheLoadStoreSpec (from TierCacheManager) is accepted")
    return spec.to_cpu_spec()
