"""One replayed engine: vLLM 0.33's real ``Scheduler`` (its KVCacheManager, prefix caching
on, and the scheduler role of whatever connector the system gives it) stepped on the
replay's clock.

``step(now)`` runs one engine step and returns how long it lasts (``cost.CostModel``).
Transfer jobs take ``bytes / bandwidth`` on the engine's line for their direction
(``TransferLine``: loads from when the step starts, stores from when it ends, as vLLM's
worker defers a step's stores to the next step); the worker (``worker.KVWorker``) says a
job is done, the engine tells the scheduler only once the clock has passed its end. So the
scheduler sees exactly what a GPU engine's would: a request waits for its load, blocks
being stored stay fenced until the store ends.

A load whose blocks include some the connector promoted from tiercache's disk tier (their
hit source is DISK, as vLLM counts them) reads those first, each promotion once
(``_disk_blocks``): ``cost.disk_read_s`` of them on ``disk_line``, one line for the
node's one disk tier (``systems.Arm`` gives every engine of an arm the same), and the job
enters the engine's load line only when they are read. So a disk hit waits for its read
and then for its host-to-GPU copy, and engines promoting at once share the disk's rate.
(A served tiercache reads the disk while the lookup is pending, before vLLM issues the
load, so another request's host-only load would not queue behind it; here a load
submitted later on the same engine does, the line being in submission order: an
overstatement, where the disk reads were free before.)

The "model" generates ``trace.response_token_ids(prompt)``: a chat turn that re-sends an
earlier answer finds that answer's KV.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tiercache.tools.replay.cost import Chunk, CostModel
from tiercache.tools.replay.trace import TraceRequest, response_token_ids
from tiercache.tools.replay.worker import KVWorker


@dataclass
class TransferLine:
    """One direction of an engine's PCIe link: jobs run one after another."""

    free_at_s: float = 0.0

    def submit(self, now_s: float, seconds: float) -> float:
        """The job's end, queued behind what is already on the line."""
        self.free_at_s = max(now_s, self.free_at_s) + seconds
        return self.free_at_s


@dataclass
class DiskLine(TransferLine):
    """The node's disk tier on the clock: its reads, one after another, and which
    promotion each key's last read was (``read``: key -> the host slot, id and
    generation, the tier promoted it into)."""

    read: dict[Any, Any] = field(default_factory=dict)


@dataclass
class RequestRecord:
    """One replayed request, as the report counts it."""

    req_id: str
    engine: int
    arrival_s: float
    prompt_tokens: int
    output_len: int
    first_token_s: float | None = None
    finish_s: float | None = None
    gpu_hit_tokens: int = 0
    external_hit_tokens: int = 0
    disk_read_blocks: int = 0  # of its load, the blocks read from the disk tier first
    response: list[int] = field(default_factory=list)

    @property
    def ttft_s(self) -> float:
        assert self.first_token_s is not None, f"{self.req_id} produced no token"
        return self.first_token_s - self.arrival_s


@dataclass
class _Job:
    due_s: float
    req_id: str | None  # an asynchronous load's request (vLLM's finished_recving)
    done: bool = False


class ReplayEngine:
    """See the module docstring. Built by ``systems`` (scheduler, worker)."""

    def __init__(self, index: int, scheduler: Any, worker: KVWorker, cost: CostModel):
        self.index = index
        self.scheduler = scheduler
        self.worker = worker
        self.cost = cost
        self.load_line = TransferLine()
        self.store_line = TransferLine()
        self.disk_line = DiskLine()  # the node's disk tier: shared by an arm's engines
        self.jobs: dict[int, _Job] = {}
        self.records: dict[str, RequestRecord] = {}
        self.busy_until_s = 0.0
        self.disk_hit_tokens = 0
        self.disk_read_blocks = 0  # blocks read from the disk tier on the clock
        self.disk_read_s = 0.0
        self.checked_blocks = 0
        self.loaded_blocks = 0
        self.steps = 0
        self.before_step: Callable[[], None] | None = None  # e.g. the disk tier's settle

    # ------------------------------------------------------------------ requests
    def add(self, req_id: str, request: TraceRequest, now_s: float) -> None:
        from vllm import SamplingParams
        from vllm.utils.hashing import sha256
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=request.output_len, ignore_eos=True)
        self.records[req_id] = RequestRecord(
            req_id, self.index, now_s, request.prompt_len, request.output_len,
            response=response_token_ids(request.prompt_token_ids, request.output_len))
        self.scheduler.add_request(Request(
            request_id=req_id, prompt_token_ids=list(request.prompt_token_ids),
            sampling_params=params, pooling_params=None,
            block_hasher=get_request_block_hasher(self.scheduler.block_size, sha256)))

    @property
    def num_unfinished(self) -> int:
        return sum(1 for r in self.records.values() if r.finish_s is None)

    @property
    def has_work(self) -> bool:
        connector = self.scheduler.connector
        return (self.scheduler.has_requests() or bool(self.jobs)
                or (connector is not None and connector.has_pending_push_work()))

    # ------------------------------------------------------------------ one step
    def step(self, now_s: float) -> float:
        from vllm.v1.outputs import ModelRunnerOutput

        if self.before_step is not None:
            self.before_step()
        out = self.scheduler.schedule()
        self._count_sources()
        sync_end_s = self._submit_loads(out.kv_connector_metadata, now_s)
        reqs = [r for r in self.scheduler.running if r.request_id in out.num_scheduled_tokens]
        chunks = []
        for r in reqs:  # schedule() has already counted this step's tokens as computed
            n = out.num_scheduled_tokens[r.request_id]
            chunks.append(Chunk(n, r.num_computed_tokens - n))
        assert sum(c.new_tokens for c in chunks) == out.total_num_scheduled_tokens
        step_s = self.cost.step_s(chunks) + max(0.0, sync_end_s - now_s)
        end_s = now_s + step_s
        self._submit_stores(out.kv_connector_metadata, end_s)
        report = self.worker.run(self.scheduler, out)
        self.checked_blocks += report.checked_blocks
        self.loaded_blocks += report.loaded_blocks
        for job_id in report.completed_jobs:
            self.jobs[job_id].done = True
        connector_output = self._release(end_s)
        sampled = [self._sample(r) for r in reqs]
        output = ModelRunnerOutput(
            req_ids=[r.request_id for r in reqs],
            req_id_to_index={r.request_id: i for i, r in enumerate(reqs)},
            sampled_token_ids=sampled, logprobs=None, prompt_logprobs_dict={},
            pooler_output=None, kv_connector_output=connector_output)
        for outputs in self.scheduler.update_from_output(out, output).values():
            for o in outputs.outputs:
                self._record(o, end_s)
        self.steps += 1
        self.busy_until_s = end_s
        return step_s

    def _sample(self, request: Any) -> list[int]:
        """The next response token, once the request's prompt is computed (a partial
        prefill samples nothing)."""
        if request.num_computed_tokens < request.num_tokens:
            return []
        response = self.records[request.request_id].response
        return [response[min(len(request.output_token_ids), len(response) - 1)]]

    def _record(self, o: Any, end_s: float) -> None:
        record = self.records[o.request_id]
        if o.new_token_ids and record.first_token_s is None:
            record.first_token_s = end_s
        if o.prefill_stats is not None:
            record.gpu_hit_tokens = o.prefill_stats.num_local_cached_tokens
            record.external_hit_tokens = o.prefill_stats.num_external_cached_tokens
        if o.finish_reason is not None:
            record.finish_s = end_s

    def _count_sources(self) -> None:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        stats = self.scheduler.connector_prefix_cache_stats
        if stats is not None:
            self.disk_hit_tokens += stats.hits_by_source.get(CacheHitSource.DISK, 0)
            stats.hits_by_source.clear()

    # ------------------------------------------------------------------ transfers
    def _submit_loads(self, meta: Any, now_s: float) -> float:
        sync_end_s = now_s
        for job_id, job in (meta.load_jobs.items() if meta is not None else ()):
            start_s = now_s
            disk_blocks = self._disk_blocks(job_id, job.req_id)
            if disk_blocks:
                seconds = self.cost.disk_read_s(disk_blocks)
                start_s = self.disk_line.submit(now_s, seconds)
                self.disk_read_blocks += disk_blocks
                self.disk_read_s += seconds
                self.records[job.req_id].disk_read_blocks += disk_blocks
            due = self.load_line.submit(start_s, self.cost.load_s(len(job.dst_spec.block_ids)))
            self.jobs[job_id] = _Job(due, None if job.sync else job.req_id)
            if job.sync:
                sync_end_s = max(sync_end_s, due)
        return sync_end_s

    def _disk_blocks(self, job_id: int, req_id: str) -> int:
        """The GPU blocks of load ``job_id`` that the disk tier reads for it: keys the
        connector's manager says came from disk (``get_load_source``: DISK, as vLLM counts
        a hit's source; the keys stay leased until the load completes), each promotion
        once on the node: only the first load after the promotion (a host slot of a new id
        or generation) reads the disk. (The index tells a promotion to the first lease that
        holds the block only; should a later lease still say DISK for the same slot, as
        before ``db0affa``, it reads host memory here.)"""
        from vllm.v1.metrics.cache_hit_source import CacheHitSource

        connector = self.scheduler.connector.connector_scheduler
        manager = connector.manager
        context = connector._req_status[req_id].req_context
        read = self.disk_line.read
        disk_keys = 0
        for key in connector._jobs[job_id].keys:
            if manager.get_load_source(key, context) != CacheHitSource.DISK:
                continue
            slot = manager.book.held[key].slot  # only tiercache's manager answers DISK
            if read.get(key) != slot:
                read[key] = slot
                disk_keys += 1
        return disk_keys * connector.config.blocks_per_chunk

    def _submit_stores(self, meta: Any, end_s: float) -> None:
        flush = (meta.jobs_to_flush or set()) if meta is not None else set()
        for job_id, job in (meta.store_jobs.items() if meta is not None else ()):
            # a flushed store (a preempted request's blocks) runs before the step ends
            start = end_s if job_id not in flush else self.busy_until_s
            self.jobs[job_id] = _Job(
                self.store_line.submit(start, self.cost.store_s(len(job.src_spec.block_ids))),
                None)

    def _release(self, end_s: float) -> Any:
        """The jobs done by the worker and over on the clock, as the worker would report."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import (
            OffloadingWorkerMetadata,
        )
        from vllm.v1.outputs import KVConnectorOutput

        if self.scheduler.connector is None:
            return None
        over = [job_id for job_id, job in self.jobs.items() if job.done and job.due_s <= end_s]
        meta = OffloadingWorkerMetadata()
        recving: set[str] = set()
        for job_id in over:
            job = self.jobs.pop(job_id)
            meta.mark_completed(job_id)
            if job.req_id is not None:
                recving.add(job.req_id)
        return KVConnectorOutput(finished_sending=set(), finished_recving=recving,
                                 kv_connector_worker_meta=meta if over else None)

    def next_wake_s(self) -> float | None:
        """When this engine next needs a step on its own (a transfer ending), if idle."""
        return min((job.due_s for job in self.jobs.values()), default=None)

    def shutdown(self) -> None:
        self.worker.shutdown()
        self.scheduler.shutdown()
