"""The worker side of a replayed engine: what runs the step's transfer jobs.

``KVWorker.run(output)`` gets one scheduler step's output and answers which transfer jobs
the worker finished in it (and which requests' loads): the engine holds each completion
until the clock says its bytes have crossed the link (``engine.ReplayEngine``), so a worker
only decides *whether* bytes moved, never *when*.

* ``VirtualWorker``: no bytes; every job the scheduler hands it is done at once (vLLM's CPU
  offloading on this CPU-only machine, whose GPU copy worker cannot run: vLLM's real
  scheduler-side manager keeps the books, the clock keeps the time).
* ``ContentWorker``: vLLM's real ``OffloadingConnector`` worker role over host KV tensors
  (``TierCacheOffloadingSpec``: real bytes through tiercache's worker and region). The
  "model" writes each block it completes with bytes derived from the block's hash (the
  prefix it ends); every block a load brings in, and every block a request holds before
  it computes, is checked against that rule, so a wrong byte fails the replay
  (``ReplayIntegrityError``, an AssertionError: it is a bug, never a result).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

NULL_BLOCK = 0  # vLLM's BlockPool hands block 0 out as the null block


@dataclass
class WorkerReport:
    """What a worker finished during one step."""

    completed_jobs: set[int] = field(default_factory=set)
    checked_blocks: int = 0  # blocks a request held (prefix hits, earlier loads) when it computed
    loaded_blocks: int = 0  # blocks that finished loading, each checked as it landed


class KVWorker(Protocol):
    def run(self, scheduler: Any, output: Any) -> WorkerReport:
        """Run the step's jobs (``output``: vLLM's SchedulerOutput) and the model's writes."""
        ...

    def shutdown(self) -> None: ...


class VirtualWorker:
    """See the module docstring."""

    def run(self, scheduler: Any, output: Any) -> WorkerReport:
        meta = output.kv_connector_metadata
        if meta is None:
            return WorkerReport()
        return WorkerReport(set(meta.load_jobs) | set(meta.store_jobs))

    def shutdown(self) -> None:
        pass


class ReplayIntegrityError(AssertionError):
    """A block held or loaded by a replayed engine does not hold its prefix's bytes."""


def block_pattern(block_hash: bytes, page_bytes: int) -> np.ndarray:
    data = bytes(block_hash)
    return np.frombuffer(data * (page_bytes // len(data) + 1), dtype=np.uint8)[:page_bytes]


class ContentWorker:
    """See the module docstring. ``caches``: the engine's KV tensors by layer name (host
    tensors), one KV-cache group (``layers``) of full attention."""

    def __init__(self, vllm_config: Any, kv_cache_config: Any, caches: dict[str, Any]):
        from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
            OffloadingConnector,
        )

        self.caches = caches
        self.connector = OffloadingConnector(vllm_config, KVConnectorRole.WORKER,
                                             kv_cache_config)
        self.connector.register_kv_caches(caches)
        self.loads: dict[int, tuple[str, list[int]]] = {}

    @property
    def _worker(self) -> Any:
        return self.connector.connector_worker.worker

    def run(self, scheduler: Any, output: Any) -> WorkerReport:
        from vllm.forward_context import ForwardContext

        meta = output.kv_connector_metadata
        report = WorkerReport()
        for job_id, job in meta.load_jobs.items():
            self.loads[job_id] = (job.req_id, job.dst_spec.block_ids.tolist())
        wc = self.connector
        wc.handle_preemptions(meta)
        wc.bind_connector_metadata(meta)
        wc.start_load_kv(ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={}))
        report.checked_blocks += self._compute(scheduler, output)
        wc.wait_for_save()
        self._worker.wait(self._worker.jobs_in_flight)  # bytes now; the clock says when
        wc.get_finished(output.finished_req_ids)
        worker_meta = wc.build_connector_worker_meta()
        wc.clear_connector_metadata()
        for job_id in (worker_meta.completed_jobs if worker_meta else {}):
            report.completed_jobs.add(job_id)
            load = self.loads.pop(job_id, None)
            if load is not None:
                report.loaded_blocks += self._check_load(scheduler, *load)
        return report

    def shutdown(self) -> None:
        self.connector.shutdown()

    # ------------------------------------------------------------------ the content rule
    def _page(self, block_id: int, layer: str) -> np.ndarray:
        page = self.caches[layer][block_id]
        assert page.is_contiguous(), "a layer's page of one block is contiguous (LBHNC)"
        return np.asarray(page.view(_uint8()).reshape(-1).numpy())

    def _compute(self, scheduler: Any, output: Any) -> int:
        """Check what each scheduled request holds, then write the blocks it completes."""
        checked = 0
        for req_id, num_new in output.num_scheduled_tokens.items():
            request = scheduler.requests[req_id]
            end = request.num_computed_tokens  # schedule() advanced it past this step
            start = end - num_new
            (block_ids,) = scheduler.kv_cache_manager.get_block_ids(req_id)
            hashes = request.block_hashes
            for index in range(start // _tokens(scheduler)):
                checked += self._check(req_id, index, block_ids[index], hashes[index])
            for index in range(start // _tokens(scheduler), end // _tokens(scheduler)):
                if block_ids[index] != NULL_BLOCK:
                    for layer in self.caches:
                        page = self._page(block_ids[index], layer)
                        page[:] = block_pattern(hashes[index], page.size)
        return checked

    def _check(self, req_id: str, index: int, block_id: int, block_hash: bytes) -> int:
        if block_id == NULL_BLOCK:
            return 0
        for layer in self.caches:
            page = self._page(block_id, layer)
            if not np.array_equal(page, block_pattern(block_hash, page.size)):
                raise ReplayIntegrityError(f"request {req_id}: block {index} (GPU block "
                                           f"{block_id}) layer {layer} holds wrong KV bytes")
        return 1

    def _check_load(self, scheduler: Any, req_id: str, loaded: list[int]) -> int:
        request = scheduler.requests.get(req_id)
        if request is None:  # finished (aborted) while loading: its blocks are gone
            return 0
        (block_ids,) = scheduler.kv_cache_manager.get_block_ids(req_id)
        return sum(self._check(req_id, block_ids.index(b), b,
                               request.block_hashes[block_ids.index(b)]) for b in loaded)


def _tokens(scheduler: Any) -> int:
    return int(scheduler.block_size)


def _uint8() -> Any:
    import torch

    return torch.uint8
