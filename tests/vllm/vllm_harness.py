"""One vLLM engine on CPU, stepped by hand: vLLM's real ``Scheduler`` (with the scheduler
role of ``OffloadingConnector``) and the worker role of ``OffloadingConnector`` over CPU
KV tensors, both with ``TierCacheOffloadingSpec`` against a running coordinator.

The "model" is a content rule: when a step computes tokens of a request, every GPU block
those tokens touch is filled, in every layer, with bytes derived from the token prefix
that ends at the block's end (what real KV depends on). Before the model computes, every
block the request already holds in full (GPU prefix hits and loads from tiercache) is
checked against the same rule, so a wrong load fails the step, and each finished load is
also checked explicitly (``loads``).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig, DeviceConfig, KVEventsConfig, KVTransferConfig, ModelConfig, SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.v1 import KVConnectorRole
from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
from vllm.forward_context import ForwardContext
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig, OffloadingModelConfig,
    OffloadingParallelConfig,
)

from tiercache.config import Config, ExporterConfig, KVGeometry, RegionConfig

BLOCK_TOKENS = 16
NULL_BLOCK = 0  # vLLM's BlockPool hands block 0 out as the null block (nothing cached there)
EOS_TOKEN = 255
SAMPLED_TOKEN = 7


@dataclass(frozen=True)
class TinyModel:
    """A Llama shape small enough for CPU tests; only its config.json exists."""

    num_layers: int = 2
    num_kv_heads: int = 2
    head_dim: int = 16
    dtype: str = "float16"

    @property
    def page_bytes(self) -> int:
        """One layer's K and V for one 16-token block (vLLM's LBHNC per-layer page)."""
        return 2 * self.num_kv_heads * BLOCK_TOKENS * self.head_dim * torch.finfo(
            getattr(torch, self.dtype)).bits // 8

    def write(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": self.num_kv_heads * 2 * self.head_dim, "intermediate_size": 128,
            "num_attention_heads": self.num_kv_heads * 2, "num_key_value_heads": self.num_kv_heads,
            "num_hidden_layers": self.num_layers, "head_dim": self.head_dim, "vocab_size": 256,
            "max_position_embeddings": 4096, "torch_dtype": self.dtype, "rms_norm_eps": 1e-5}))
        return directory

    def coordinator_config(self, name: str, socket: str, num_chunks: int,
                           blocks_per_chunk: int = 1, index_events: bool = False,
                           disk=None, cluster=None) -> Config:
        return Config(name=name, world_size=1, disk=disk, cluster=cluster,
                      kv=KVGeometry(page_bytes=(self.page_bytes,) * self.num_layers,
                                    block_size_factor=blocks_per_chunk, block_tokens=BLOCK_TOKENS),
                      region=RegionConfig(capacity_bytes=None, num_blocks=num_chunks,
                                          prefault_threads=1),
                      exporter=ExporterConfig(enabled=False), control_socket=socket,
                      index_events=index_events)  # the session share as users get it


def offloading_config(coordinator, model, *, events=False, **extra) -> OffloadingConfig:
    """An OffloadingConfig as vLLM's connector builds it for ``model`` on one rank."""
    layers = tuple(f"model.layers.{i}.self_attn.attn" for i in range(model.num_layers))
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(16, layers, 0),),
        worker_kv_bytes_per_block=model.page_bytes * model.num_layers,
        enable_kv_cache_events=events,
        extra_config={"spec_name": "TierCacheOffloadingSpec", "spec_module_path": "tiercache.vllm",
                      "tiercache_config": str(coordinator.config_path), **extra},
        engine_id="engine-test", model=OffloadingModelConfig("tiny-llama", "float16", 4096),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, None, True),
        kv_cache_layout="LBHNC")


def expected_block(tokens: Sequence[int], end: int, layer: int, page_bytes: int) -> np.ndarray:
    """The KV bytes of the block that ends at token ``end`` (exclusive), one layer."""
    digest = hashlib.sha256(np.asarray(tokens[:end], dtype=np.int64).tobytes()
                            + layer.to_bytes(2, "little")).digest()
    return np.frombuffer(digest * (page_bytes // len(digest) + 1), dtype=np.uint8)[:page_bytes]


class RecordingPublisher:
    """Stands in for vLLM's KV-event publisher (zmq): keeps what the scheduler publishes."""

    def __init__(self):
        self.events: list[Any] = []

    def publish(self, batch) -> None:
        self.events.extend(batch.events)

    def shutdown(self) -> None:
        pass


@dataclass
class LoadRecord:
    req_id: str
    job_id: int
    gpu_blocks: list[int]  # every group's, group by group (vLLM's GPULoadStoreSpec)
    slots: list[int]
    group_sizes: tuple[int, ...] = ()  # blocks per KV-cache group in gpu_blocks
    checked: bool = False

    def by_group(self) -> list[list[int]]:
        sizes = self.group_sizes or (len(self.gpu_blocks),)
        ends = np.cumsum(sizes)
        return [self.gpu_blocks[end - size:end] for size, end in zip(sizes, ends)]


@dataclass
class Engine:
    """See the module docstring. Build with ``Engine.build``."""

    scheduler: Scheduler
    worker_connector: OffloadingConnector
    caches: dict[str, torch.Tensor]
    model: TinyModel | None  # None: a published model's shape (build_for)
    layer_groups: list[list[str]]  # each KV-cache group's layers (one group: no HMA)
    tokens: dict[str, list[int]] = field(default_factory=dict)
    loads: dict[int, LoadRecord] = field(default_factory=dict)
    finished_loads: list[LoadRecord] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)
    preempted: set[str] = field(default_factory=set)
    hits_by_source: dict = field(default_factory=dict)  # vLLM's external hits by tier
    check_content: bool = True  # False: no KV writes or checks (benchmarks)
    kv_events: RecordingPublisher = field(default_factory=RecordingPublisher)
    steps: int = 0

    @classmethod
    def build(cls, model: TinyModel, model_dir: Path, coordinator_config_path: Path, *,
              num_gpu_blocks: int = 64, max_num_batched_tokens: int = 1024,
              max_num_seqs: int = 16, blocks_per_chunk: int = 1, kv_events: bool = False,
              extra: dict[str, Any] | None = None, check_content: bool = True) -> Engine:
        model_config = ModelConfig(model=str(model_dir), skip_tokenizer_init=True,
                                   dtype=model.dtype, max_model_len=4096, seed=0)
        scheduler_config = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=4096, enable_chunked_prefill=True, is_encoder_decoder=False)
        scheduler_config.async_scheduling = False
        cache_config = CacheConfig(block_size=BLOCK_TOKENS, gpu_memory_utilization=0.9,
                                   cache_dtype="auto", enable_prefix_caching=True)
        cache_config.kv_cache_layout = "LBHNC"  # what OffloadingConnector asks for
        extra_config = {"spec_name": "TierCacheOffloadingSpec",
                        "spec_module_path": "tiercache.vllm",
                        "tiercache_config": str(coordinator_config_path), **(extra or {})}
        if blocks_per_chunk != 1:
            extra_config["blocks_per_chunk"] = blocks_per_chunk
        vllm_config = VllmConfig(
            scheduler_config=scheduler_config, model_config=model_config, cache_config=cache_config,
            kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector",
                                                kv_role="kv_both",
                                                kv_connector_extra_config=extra_config),
            # the events are recorded (RecordingPublisher below): vLLM's zmq publisher would
            # bind tcp://*:5557, which two engines of parallel tests cannot both have
            kv_events_config=(KVEventsConfig(enable_kv_cache_events=True, publisher="null")
                              if kv_events else None),
            device_config=DeviceConfig("cpu"))
        layers = [f"model.layers.{i}.self_attn.attn" for i in range(model.num_layers)]
        spec = FullAttentionSpec(block_size=BLOCK_TOKENS, num_kv_heads=model.num_kv_heads,
                                 head_size=model.head_dim, dtype=getattr(torch, model.dtype))
        kv_cache_config = KVCacheConfig(num_blocks=num_gpu_blocks, kv_cache_tensors=[],
                                        kv_cache_groups=[KVCacheGroupSpec(layers, spec)])
        vllm_config.cache_config.num_gpu_blocks = num_gpu_blocks
        caches = {name: torch.zeros((num_gpu_blocks, 2, BLOCK_TOKENS, model.num_kv_heads,
                                     model.head_dim), dtype=getattr(torch, model.dtype))
                  for name in layers}
        return cls._start(vllm_config, kv_cache_config, caches, model, [layers],
                          check_content=check_content)

    @classmethod
    def build_for(cls, model_dir: Path, coordinator_config_path: Path, options, *,
                  num_gpu_blocks: int = 64, max_num_batched_tokens: int = 1024,
                  max_num_seqs: int = 16, extra: dict[str, Any] | None = None) -> Engine:
        """An engine of a published model's shape (its config.json): the VllmConfig, KV-cache
        groups and tensors a GPU engine resolves, from ``tiercache.vllm.model_kv``
        (``options``: its ``ServingOptions``, TP 1)."""
        from tiercache.vllm.model_kv import (
            allocate_caches, build_kv_cache_config, build_vllm_config,
        )

        extra_config = {"spec_name": "TierCacheOffloadingSpec",
                        "spec_module_path": "tiercache.vllm",
                        "tiercache_config": str(coordinator_config_path), **(extra or {})}
        vllm_config = build_vllm_config(model_dir, options, extra_config,
                                        max_num_seqs=max_num_seqs,
                                        max_num_batched_tokens=max_num_batched_tokens,
                                        language_model_only=True)  # the harness sends text
        vllm_config.scheduler_config.async_scheduling = False
        kv_cache_config = build_kv_cache_config(vllm_config, num_gpu_blocks)
        vllm_config.cache_config.num_gpu_blocks = kv_cache_config.num_blocks
        caches = allocate_caches(vllm_config, kv_cache_config, torch.device("cpu"))
        groups = [list(g.layer_names) for g in kv_cache_config.kv_cache_groups]
        return cls._start(vllm_config, kv_cache_config, caches, None, groups)

    @classmethod
    def _start(cls, vllm_config, kv_cache_config, caches, model, layer_groups, *,
               check_content: bool = True) -> Engine:
        scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                              log_stats=True,
                              structured_output_manager=StructuredOutputManager(vllm_config),
                              block_size=BLOCK_TOKENS)
        worker_connector = OffloadingConnector(vllm_config, KVConnectorRole.WORKER, kv_cache_config)
        worker_connector.register_kv_caches(caches)
        init_none_hash(sha256)
        engine = cls(scheduler, worker_connector, caches, model, layer_groups,
                     check_content=check_content)
        scheduler.kv_event_publisher.shutdown()  # vLLM's own (the null one): replaced
        scheduler.kv_event_publisher = engine.kv_events
        return engine

    # ------------------------------------------------------------------ parts
    @property
    def manager(self):
        return self.scheduler.connector.connector_scheduler.manager

    @property
    def tiercache_worker(self):
        return self.worker_connector.connector_worker.worker

    def block_bytes(self, block_id: int, layer: int | str) -> np.ndarray:
        """One layer's page of a GPU block, writable (the layer by index or name)."""
        cache = self.caches[layer] if isinstance(layer, str) else list(self.caches.values())[layer]
        page = cache[block_id]
        assert page.is_contiguous(), "a layer's page of one block is contiguous (LBHNC)"
        return page.view(torch.uint8).reshape(-1).numpy()

    def _layer_index(self, name: str) -> int:
        return list(self.caches).index(name)

    # ------------------------------------------------------------------ driving
    def add_request(self, req_id: str, tokens: Sequence[int], max_tokens: int = 2) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=False)
        params.update_from_generation_config({}, EOS_TOKEN)
        self.tokens[req_id] = list(tokens)
        self.scheduler.add_request(Request(
            request_id=req_id, prompt_token_ids=list(tokens), sampling_params=params,
            pooling_params=None, block_hasher=get_request_block_hasher(BLOCK_TOKENS, sha256)))

    def abort(self, req_id: str) -> None:
        """The client went away (vLLM's ``abort_requests``): the request finishes as it is."""
        self.scheduler.finish_requests(req_id, RequestStatus.FINISHED_ABORTED)

    def step(self, *, flush: bool = True, model_s: float = 0.0) -> SchedulerOutput:
        """One engine step. ``model_s``: the forward pass's time (slept after the copies
        are started, while the flusher sends the step's batch). ``flush=False``: do not wait
        for the flusher at the end (a real engine does not: its next step may start
        before the coordinator answered)."""
        out = self.scheduler.schedule()
        stats = self.scheduler.connector_prefix_cache_stats  # reset by the step's make_stats
        if stats is not None:
            for source, tokens in stats.hits_by_source.items():
                self.hits_by_source[source] = self.hits_by_source.get(source, 0) + tokens
            stats.hits_by_source.clear()
        self.preempted.update(out.preempted_req_ids or ())
        meta = out.kv_connector_metadata
        for job_id, job in meta.load_jobs.items():
            self.loads[job_id] = LoadRecord(job.req_id, job_id, job.dst_spec.block_ids.tolist(),
                                            list(job.src_spec.slot_ids),
                                            tuple(job.dst_spec.group_sizes or ()))
        wc = self.worker_connector
        wc.handle_preemptions(meta)
        wc.bind_connector_metadata(meta)
        wc.start_load_kv(ForwardContext(no_compile_layers={}, attn_metadata={}, slot_mapping={}))
        self._compute(out)
        if model_s:
            time.sleep(model_s)
        # vLLM's model runner calls wait_for_save in every step, a step without a forward
        # pass included (``kv_connector_no_forward``): it queues the step's store jobs for the
        # next step. (Skipping it there lost a store job that the scheduler issued in a step
        # with nothing to compute, and the engine never went idle.)
        wc.wait_for_save()
        if out.total_num_scheduled_tokens == 0:
            # no forward pass to overlap with: let the copies finish, as a GPU step would
            self.tiercache_worker.wait(self.tiercache_worker.jobs_in_flight)
        sending, recving = wc.get_finished(out.finished_req_ids)
        worker_meta = wc.build_connector_worker_meta()
        wc.clear_connector_metadata()
        for job_id in (worker_meta.completed_jobs if worker_meta else {}):
            record = self.loads.pop(job_id, None)
            if record is not None:
                self._check_load(record)
        reqs = [r for r in self.scheduler.running if r.request_id in out.num_scheduled_tokens]
        output = ModelRunnerOutput(
            req_ids=[r.request_id for r in reqs],
            req_id_to_index={r.request_id: i for i, r in enumerate(reqs)},
            sampled_token_ids=[[SAMPLED_TOKEN] for _ in reqs], logprobs=None,
            prompt_logprobs_dict={}, pooler_output=None,
            kv_connector_output=KVConnectorOutput(finished_sending=sending,
                                                  finished_recving=recving,
                                                  kv_connector_worker_meta=worker_meta))
        engine_outputs = self.scheduler.update_from_output(out, output)
        for outputs in engine_outputs.values():
            for o in outputs.outputs:
                if o.finished:
                    self.finished.add(o.request_id)
        if flush:
            assert self.manager.wait_flushed(60.0), "tiercache flusher did not answer in 60 s"
        self.steps += 1
        return out

    def run(self, max_steps: int = 200) -> None:
        """Until every request finished and no transfer or flush is pending."""
        for _ in range(max_steps):
            connector = self.scheduler.connector
            if not self.scheduler.has_requests() and not connector.has_pending_push_work():
                return
            self.step()
        book = self.manager.book
        raise AssertionError(
            f"engine still busy after {max_steps} steps: requests {list(self.scheduler.requests)}, "
            f"jobs {list(self.scheduler.connector.connector_scheduler._jobs)}, "
            f"tiercache pending {book.has_pending_work} (held {len(book.held)}, writing "
            f"{len(book.writing)})")

    def shutdown(self) -> None:
        self.worker_connector.shutdown()
        self.scheduler.shutdown()

    # ------------------------------------------------------------------ the content rule
    def _compute(self, out: SchedulerOutput) -> None:
        if not self.check_content:
            return
        for req_id, num_new in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            start = request.num_computed_tokens - num_new  # schedule() already advanced it
            tokens = self.tokens[req_id] + [SAMPLED_TOKEN] * len(request.output_token_ids)
            groups = self.scheduler.kv_cache_manager.get_block_ids(req_id)
            end = start + num_new
            for layers, block_ids in zip(self.layer_groups, groups):
                for index in range(min(start // BLOCK_TOKENS, len(block_ids))):
                    self._check_block(req_id, tokens, index, block_ids[index], layers)
                for index in range(start // BLOCK_TOKENS, -(-end // BLOCK_TOKENS)):
                    if block_ids[index] == NULL_BLOCK:
                        continue
                    block_end = min((index + 1) * BLOCK_TOKENS, end)
                    for name in layers:
                        page = self.block_bytes(block_ids[index], name)
                        page[:] = expected_block(tokens, block_end, self._layer_index(name),
                                                 page.size)

    def _check_block(self, req_id: str, tokens: list[int], index: int, block_id: int,
                     layers: list[str] | None = None) -> None:
        """A block the request holds in full has the bytes the model computed for its
        prefix (a sliding window's dropped blocks, the null block, hold nothing)."""
        if block_id == NULL_BLOCK:
            return
        for name in layers if layers is not None else list(self.caches):
            got = self.block_bytes(block_id, name)
            want = expected_block(tokens, (index + 1) * BLOCK_TOKENS, self._layer_index(name),
                                  got.size)
            if not np.array_equal(got, want):
                raise AssertionError(f"request {req_id}: block {index} (GPU block {block_id}) "
                                     f"layer {name} holds wrong KV bytes")

    def _check_load(self, record: LoadRecord) -> None:
        """Every GPU block a load wrote holds what the model computed for that prefix."""
        if not self.check_content:
            self.finished_loads.append(record)
            return
        tokens = self.tokens[record.req_id]
        groups = self.scheduler.kv_cache_manager.get_block_ids(record.req_id)
        for layers, block_ids, loaded in zip(self.layer_groups, groups, record.by_group()):
            for block_id in loaded:
                self._check_block(record.req_id, tokens, block_ids.index(block_id), block_id,
                                  layers)
        record.checked = True
        self.finished_loads.append(record)

    def loaded_tokens(self, req_id: str) -> int:
        """Tokens this request got from tiercache (checked loads only): a full-attention
        group's blocks (the most of any group; a sliding window loads only its window)."""
        return BLOCK_TOKENS * sum(max(map(len, r.by_group())) for r in self.finished_loads
                                  if r.req_id == req_id)
