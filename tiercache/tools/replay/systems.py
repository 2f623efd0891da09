"""The systems a replay compares, each as N engines (``engine.ReplayEngine``) sized alike:
the same model, GPU block budget, scheduler limits and total host memory.

* ``none``: vLLM 0.33 without a connector (GPU prefix caching only).
* ``vllm_native``: vLLM 0.33's own CPU offloading, ``OffloadingConnector`` with vLLM's
  ``CPUOffloadingSpec``, one per engine with ``dram_bytes / N`` (``cpu_bytes_to_use``): vLLM's
  scheduler-side manager keeps the books, a ``VirtualWorker`` stands for its GPU copy
  worker (CUDA only), the clock for its copies.
* ``tiercache``: one real ``tiercache serve`` with all of ``dram_bytes`` (and the disk tier,
  if any), every engine attached through ``TierCacheOffloadingSpec``; real bytes move
  through tiercache's worker on host tensors and every loaded block is checked
  (``worker.ContentWorker``). The bytes are scaled down: the engines of this arm run a
  stand-in of the model with ``STANDIN`` KV (one layer, 2 KiB per block) and the region
  holds as many blocks as ``dram_bytes`` holds of the real model's, so the report states
  the factor (``bytes_scale``); the scheduler sees the same blocks, the cost model the
  real model's bytes. Models of more than one KV-cache group (sliding-window hybrids) are
  refused: the stand-in has one. With the prefix router the coordinator runs its node
  event stream (``[events]`` on loopback, ports the kernel picks) and the arm subscribes
  to it (``Arm.node``: ``nodestream.NodeStreamView``); its engines then turn their own
  CPU-tier events off, as on any node whose coordinator publishes (docs/events.md).
  With a disk tier (``--disk``: a real one, its file under the replay's temporary
  directory), each engine step first waits for the tier chain (``tierwait``), and the
  arm's engines share one disk line on the clock (``engine``: disk hits are read at the
  cost model's ``disk_read_bps``, the node's one tier).
"""

from __future__ import annotations

import enum
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiercache.config import Config, EventsConfig, ExporterConfig, KVGeometry, RegionConfig
from tiercache.config.tiers import DiskConfig
from tiercache.errors import ConfigError, UnsupportedModelError
from tiercache.region.layout import round_up
from tiercache.tiers.disk_file import ALIGN as DISK_ALIGN
from tiercache.tiers.disk_file import HEADER_BYTES as DISK_SLOT_HEADER_BYTES
from tiercache.tools.replay.cost import CostModel
from tiercache.tools.replay.engine import DiskLine, ReplayEngine
from tiercache.tools.replay.events import EventRecorder
from tiercache.tools.replay.worker import ContentWorker, VirtualWorker

BLOCK_TOKENS = 16
MAX_MODEL_LEN = 4096
# the node stream's batching: short, so that a decision's wait for the stream (nodestream's
# sync) is short in wall time; it changes nothing simulated
EVENTS_BATCH_INTERVAL_S = 0.01


class System(enum.Enum):
    NONE = "none"
    VLLM_NATIVE = "vllm_native"
    TIERCACHE = "tiercache"

    @classmethod
    def parse_list(cls, text: str) -> list[System]:
        names = [n.strip() for n in text.split(",") if n.strip()]
        allowed = ", ".join(s.value for s in cls)
        try:
            systems = [cls(n) for n in names]
        except ValueError:
            raise ConfigError(f"--systems {text!r}: allowed a comma list of {allowed}") from None
        if not systems or len(set(systems)) != len(systems):
            raise ConfigError(f"--systems {text!r}: name each of {allowed} at most once")
        return systems


@dataclass(frozen=True)
class StandIn:
    """The tiercache arm's byte-moving model: a Llama shape whose page is small."""

    num_layers: int = 1
    num_kv_heads: int = 2
    head_dim: int = 16

    @property
    def block_bytes(self) -> int:
        return 2 * self.num_kv_heads * BLOCK_TOKENS * self.head_dim * 2 * self.num_layers

    def write(self, directory: Path) -> Path:
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": self.num_kv_heads * 2 * self.head_dim, "intermediate_size": 128,
            "num_attention_heads": self.num_kv_heads * 2,
            "num_key_value_heads": self.num_kv_heads, "num_hidden_layers": self.num_layers,
            "head_dim": self.head_dim, "vocab_size": 32000,
            "max_position_embeddings": MAX_MODEL_LEN, "torch_dtype": "float16",
            "rms_norm_eps": 1e-5}))
        return directory


STANDIN = StandIn()


@dataclass(frozen=True)
class Fleet:
    """What every system's engines share."""

    model_dir: Path
    num_engines: int
    dram_bytes: int
    gpu_blocks: int
    workdir: Path
    disk_bytes: int = 0
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 4096
    kv_events: bool = False

    def __post_init__(self) -> None:
        if self.num_engines < 1:
            raise ConfigError(f"--engines {self.num_engines}: must be >= 1")
        if self.gpu_blocks < 2 * MAX_MODEL_LEN // BLOCK_TOKENS:
            raise ConfigError(f"--gpu-kv-tokens {self.gpu_blocks * BLOCK_TOKENS}: needs at least "
                              f"{2 * MAX_MODEL_LEN} (two requests of the longest length)")


def vllm_config(model_dir: Path, fleet: Fleet, extra: dict[str, Any] | None) -> Any:
    """A VllmConfig for the fleet's engines; ``extra``: the OffloadingConnector's extra
    config (None: no connector)."""
    from vllm.config import KVEventsConfig

    from tiercache.vllm.model_kv import ServingOptions, build_vllm_config

    config = build_vllm_config(model_dir, ServingOptions(block_size=BLOCK_TOKENS), extra or {},
                               max_num_seqs=fleet.max_num_seqs,
                               max_num_batched_tokens=fleet.max_num_batched_tokens,
                               language_model_only=True)
    config.scheduler_config.async_scheduling = False
    if extra is None:
        config.kv_transfer_config = None
    config.kv_events_config = (KVEventsConfig(enable_kv_cache_events=True, publisher="null")
                               if fleet.kv_events else None)
    return config


def kv_cache_config(config: Any, num_blocks: int) -> Any:
    from tiercache.vllm.model_kv import build_kv_cache_config

    kv = build_kv_cache_config(config, num_blocks)
    if len(kv.kv_cache_groups) != 1:
        raise UnsupportedModelError(
            f"{config.model_config.architecture}: {len(kv.kv_cache_groups)} KV-cache groups; "
            "tiercache replay drives one-group (full attention or MLA) models for now")
    config.cache_config.num_gpu_blocks = kv.num_blocks
    return kv


def scheduler(config: Any, kv: Any, recorder: EventRecorder | None) -> Any:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    init_none_hash(sha256)  # vLLM's module-level seed of the block-hash chain (as EngineCore)

    sched = Scheduler(vllm_config=config, kv_cache_config=kv, log_stats=True,
                      structured_output_manager=StructuredOutputManager(config),
                      block_size=BLOCK_TOKENS)
    if recorder is not None:
        sched.kv_event_publisher = recorder
    return sched


class Arm:
    """One system's engines, and what it runs beside them (tiercache's coordinator)."""

    def __init__(self, system: System, fleet: Fleet, cost: CostModel,
                 recorders: list[EventRecorder] | None = None):
        self.system = system
        self.fleet = fleet
        self.coordinator: Any = None
        self.node: Any = None  # the node stream's view (tiercache arm, prefix router)
        self.settler: Any = None  # the disk tier on the replay's clock (tiercache arm, disk)
        self.engines: list[ReplayEngine] = []
        self.host_blocks = 0
        self.bytes_scale = 1.0
        self.disk_line = DiskLine()  # the node's one disk tier, every engine's reads
        each: list[EventRecorder | None] = (list(recorders) if recorders
                                            else [None] * fleet.num_engines)
        try:
            for index, recorder in enumerate(each):
                self.engines.append(self._engine(index, cost, recorder))
                self.engines[-1].disk_line = self.disk_line
        except BaseException:
            self.close()
            raise

    def _engine(self, index: int, cost: CostModel, recorder: EventRecorder | None
                ) -> ReplayEngine:
        fleet = self.fleet
        if self.system is System.NONE:
            config = vllm_config(fleet.model_dir, fleet, None)
            kv = kv_cache_config(config, fleet.gpu_blocks)
            return ReplayEngine(index, scheduler(config, kv, recorder), VirtualWorker(), cost)
        if self.system is System.VLLM_NATIVE:
            share = fleet.dram_bytes // fleet.num_engines
            config = vllm_config(fleet.model_dir, fleet, {"spec_name": "CPUOffloadingSpec",
                                                          "cpu_bytes_to_use": share})
            kv = kv_cache_config(config, fleet.gpu_blocks)
            sched = scheduler(config, kv, recorder)
            self.host_blocks += sched.connector.connector_scheduler.manager._num_chunks
            return ReplayEngine(index, sched, VirtualWorker(), cost)
        if self.coordinator is None:
            self._start_coordinator(cost)
        from tiercache.vllm.model_kv import allocate_caches

        config = vllm_config(self._standin_dir, fleet, {
            "spec_name": "TierCacheOffloadingSpec", "spec_module_path": "tiercache.vllm",
            "tiercache_config": str(self.coordinator.config_path)})
        kv = kv_cache_config(config, fleet.gpu_blocks)
        import torch

        caches = allocate_caches(config, kv, torch.device("cpu"))
        worker = ContentWorker(config, kv, caches)
        engine = ReplayEngine(index, scheduler(config, kv, recorder), worker, cost)
        if self.settler is not None:
            engine.before_step = self.settler.settle
        return engine

    @property
    def _standin_dir(self) -> Path:
        return self.fleet.workdir / "standin-model"

    def _start_coordinator(self, cost: CostModel) -> None:
        from tiercache.service.process import CoordinatorProcess

        fleet = self.fleet
        STANDIN.write(self._standin_dir)
        self.host_blocks = fleet.dram_bytes // cost.block_bytes
        self.bytes_scale = cost.block_bytes / STANDIN.block_bytes
        disk = None
        if fleet.disk_bytes:
            disk_blocks = fleet.disk_bytes // cost.block_bytes
            # as many of the disk file's slots as the real model's blocks fit in disk_bytes
            # (a slot: its header and the stand-in's row, each 4 KiB-aligned)
            slot_bytes = DISK_SLOT_HEADER_BYTES + round_up(STANDIN.block_bytes, DISK_ALIGN)
            disk = DiskConfig(path=str(fleet.workdir), io_threads=2,
                              capacity_bytes=disk_blocks * slot_bytes)
        name = f"replay-{os.getpid()}"
        page = STANDIN.block_bytes // STANDIN.num_layers
        events = (EventsConfig(endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0",
                               batch_interval_s=EVENTS_BATCH_INTERVAL_S)
                  if fleet.kv_events else None)
        config = Config(
            name=name, world_size=1, disk=disk, events=events, index_events=fleet.kv_events,
            kv=KVGeometry(page_bytes=(page,) * STANDIN.num_layers, block_size_factor=1,
                          block_tokens=BLOCK_TOKENS),
            region=RegionConfig(capacity_bytes=None, num_blocks=self.host_blocks,
                                prefault_threads=1,  # every engine attaches rank 0
                                attachments_per_rank=max(4, fleet.num_engines)),
            exporter=ExporterConfig(enabled=False),
            control_socket=str(fleet.workdir / f"{name}.sock"))
        self.coordinator = CoordinatorProcess(config, workdir=fleet.workdir / "coordinator")
        if disk is not None:
            from tiercache.tools.replay.tierwait import TierSettler

            self.settler = TierSettler(config, disk.low_watermark)
        if events is not None:
            from tiercache.tools.replay.nodestream import NodeStreamView, bound_endpoints

            self.node = NodeStreamView(config, *bound_endpoints(self.coordinator.output()))

    def close(self) -> None:
        for engine in self.engines:
            engine.shutdown()
        self.engines = []
        for view in (self.node, self.settler):
            if view is not None:
                view.close()
        self.node = self.settler = None
        if self.coordinator is not None:
            self.coordinator.cleanup()
            self.coordinator = None
