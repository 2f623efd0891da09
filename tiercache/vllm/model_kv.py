"""What a vLLM 0.33 engine of a model announces to tiercache, asked of vLLM itself.

``tiercache config-for-vllm`` and the tests size a region from this, so the printed config
and the workers cannot disagree: the geometry comes out of the same code path a vLLM
worker runs when it starts.

1. vLLM's ``ModelConfig`` reads the model's ``config.json`` (heads per TP rank, head size,
   MLA, sliding windows, the layer types of hybrids, the KV dtype).
2. Each decoder layer of the first pipeline stage gets the ``KVCacheSpec`` its attention
   layer asks for (``FullAttentionSpec``, ``SlidingWindowSpec``, ``MLAAttentionSpec``:
   vLLM's own classes, which compute the page bytes, fp8 and padding included).
3. vLLM's planner groups the layers (the hybrid allocator's KV-cache groups) and lays out
   the KV tensors (``get_kv_cache_groups``, ``get_kv_cache_config_from_groups``).
4. vLLM's ``allocate_kv_cache`` allocates that layout on the CPU (a few blocks), and its
   ``OffloadingConnectorWorker`` registers it and builds the ``CanonicalKVCaches`` it would
   hand tiercache's worker; tiercache's own ``canonical_geometry`` turns them into the
   region geometry, as ``TierCacheWorker`` does.

Refused, with one line naming the model and why (``UnsupportedModelError``): layers that
keep recurrent state (Mamba, linear attention: vLLM pads the attention pages to the state's
size by the GPU attention backend it picks at start, and their KV tensors are shared by
groups of different page sizes, which tiercache's worker cannot address), and pipeline
stages whose geometries differ. Needs vLLM (and torch): run it in the engine's environment.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tiercache.config.hf_model import HFModel
from tiercache.errors import ConfigError, UnsupportedModelError
from tiercache.vllm.geometry import EngineGeometry

VLLM_VERSION = "0.33.0"
PROBE_BLOCKS = 4  # GPU blocks of the CPU tensors the connector registers (only the layout matters)
_ATTENTION = {"full_attention": "full", "attention": "full", "sliding_attention": "sliding"}
_STATEFUL = ("linear_attention", "mamba", "mamba2", "ssm", "recurrent", "conv")


@dataclass(frozen=True)
class ServingOptions:
    """vLLM's serving flags that change the KV geometry (its own names)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    blocks_per_chunk: int = 1  # kv_connector_extra_config blocks_per_chunk
    disable_hybrid_kv_cache_manager: bool = False

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "block_size",
                     "blocks_per_chunk"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")


@dataclass(frozen=True)
class ModelKV:
    """A model's KV under vLLM: the region geometry its workers announce, and what it is."""

    architecture: str
    geometry: EngineGeometry
    group_kinds: tuple[str, ...]  # per offloaded KV-cache group: full, sliding, mla
    kv_dtype: str  # torch's name of the cached element (fp8 as float8_e4m3fn, ...)

    @property
    def summary(self) -> str:
        kinds = sorted(set(self.group_kinds))
        return (f"{self.architecture}: {len(self.group_kinds)} KV-cache group(s) "
                f"({', '.join(kinds)}), {self.kv_dtype} KV")


def model_kv(model: str, options: ServingOptions) -> ModelKV:
    """See the module docstring. ``model``: a local model directory (or its config.json)."""
    hf = HFModel.read(model)  # a missing file, not JSON, not a decoder: one line, no vLLM
    directory = hf.path.parent
    with _quiet_vllm():
        return _model_kv(directory, options)


def _model_kv(directory: Path, options: ServingOptions) -> ModelKV:
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.worker import (
        OffloadingConnectorWorker,
    )

    vllm_config = build_vllm_config(directory, options)
    model_config = vllm_config.model_config
    architecture = model_config.architecture
    pages: list[tuple[int, ...]] = []
    kinds: tuple[str, ...] = ()
    geometry: EngineGeometry | None = None
    for pp_rank in range(options.pipeline_parallel_size):
        kv_config = build_kv_cache_config(vllm_config, PROBE_BLOCKS, pp_rank)
        probe = _ProbeSpec(build_offloading_config(vllm_config, kv_config))
        worker = OffloadingConnectorWorker(probe, vllm_config, kv_config)
        worker.register_kv_caches(allocate_caches(vllm_config, kv_config, torch.device("cpu")))
        stage = probe.geometry(options.tensor_parallel_size * options.pipeline_parallel_size)
        if geometry is None:
            geometry = stage
            kinds = tuple(_kind(g.kv_cache_spec) for g in kv_config.kv_cache_groups)
        pages.append(stage.page_bytes or ())
    if len(set(pages)) > 1:
        raise UnsupportedModelError(
            f"{architecture}: its {model_config.get_total_num_hidden_layers()} layers split "
            f"unevenly over --pipeline-parallel-size {options.pipeline_parallel_size} "
            f"({' / '.join(str(len(p)) for p in pages)} KV tensors per stage); a tiercache "
            "region needs the same geometry on every rank")
    assert geometry is not None
    kv_dtype = str(_kv_torch_dtype(vllm_config)).removeprefix("torch.")
    return ModelKV(architecture, geometry, kinds, kv_dtype)


def build_kv_cache_config(vllm_config: Any, num_blocks: int, pp_rank: int = 0) -> Any:
    """vLLM's ``KVCacheConfig`` for one pipeline stage: its planner's groups (the hybrid
    allocator's, one per attention type) and tensors, for ``num_blocks`` GPU blocks."""
    from vllm.v1.core.kv_cache_planning import (
        get_kv_cache_config_from_groups, get_kv_cache_groups,
    )

    groups = get_kv_cache_groups(vllm_config, _layer_specs(vllm_config, pp_rank))
    per_block = sum(g.kv_cache_spec.page_size_bytes * len(g.layer_names) for g in groups)
    vllm_config.cache_config.num_gpu_blocks_override = num_blocks
    return get_kv_cache_config_from_groups(vllm_config, groups, per_block * num_blocks)


def allocate_caches(vllm_config: Any, kv_config: Any, device: Any) -> dict[str, Any]:
    """The KV tensors a vLLM worker allocates for ``kv_config`` (``allocate_kv_cache``, in
    the layout the engine resolves), by layer name."""
    from vllm.v1.worker.utils import allocate_kv_cache

    layout = vllm_config.cache_config.get_resolved_kv_cache_layout()
    caches: dict[str, Any] = allocate_kv_cache(kv_config, device, layout)
    return caches


def build_vllm_config(directory: Path, options: ServingOptions,
                      extra_config: dict[str, Any] | None = None, *, max_num_seqs: int = 16,
                      max_num_batched_tokens: int = 4096, kv_events: bool = False,
                      language_model_only: bool = False) -> Any:
    """A ``VllmConfig`` for the model under these options, as a GPU engine with
    OffloadingConnector resolves it (its KV layout, the hybrid KV-cache manager)."""
    from vllm.config import (
        CacheConfig, DeviceConfig, KVEventsConfig, KVTransferConfig, ModelConfig,
        ParallelConfig, SchedulerConfig, VllmConfig,
    )

    try:
        model_config = ModelConfig(model=str(directory), skip_tokenizer_init=True,
                                   max_model_len=4096, seed=0,
                                   language_model_only=language_model_only)
    except Exception as e:  # pydantic's ValidationError, vLLM's ValueError: one message
        raise ConfigError(f"vLLM {VLLM_VERSION} cannot read the model at {str(directory)!r}: "
                          f"{_first_line(e)}") from None
    _refuse_stateful(model_config)
    parallel = ParallelConfig(tensor_parallel_size=options.tensor_parallel_size,
                              pipeline_parallel_size=options.pipeline_parallel_size)
    scheduler = SchedulerConfig(max_num_seqs=max_num_seqs,
                                max_num_batched_tokens=max_num_batched_tokens,
                                max_model_len=4096, enable_chunked_prefill=True,
                                is_encoder_decoder=False)
    cache = CacheConfig(block_size=options.block_size, cache_dtype=options.kv_cache_dtype,
                        enable_prefix_caching=True)
    extra = {**(extra_config or {}), "blocks_per_chunk": options.blocks_per_chunk}
    try:
        vllm_config = VllmConfig(
            model_config=model_config, cache_config=cache, parallel_config=parallel,
            scheduler_config=scheduler, device_config=DeviceConfig("cpu"),
            kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector",
                                                kv_role="kv_both",
                                                kv_connector_extra_config=extra),
            # the caller takes the scheduler's events (no zmq port bound for them)
            kv_events_config=(KVEventsConfig(enable_kv_cache_events=True, publisher="null")
                              if kv_events else None))
    except Exception as e:
        raise ConfigError(f"vLLM {VLLM_VERSION} refuses these serving options for "
                          f"{model_config.architecture}: {_first_line(e)}") from None
    # the layout the engine core resolves with OffloadingConnector: the one it requires
    connector = _connector_class()
    vllm_config.cache_config.kv_cache_layout = connector.get_required_kvcache_layout(vllm_config)
    # The hybrid KV-cache manager (one KV-cache group per attention type) is what a GPU engine
    # runs: vLLM turns it off on this CPU platform only because the platform lacks it; on
    # CUDA it is off only where the user says so, a connector lacks HMA or with chunked
    # local attention (VllmConfig's own rules, re-decided here for the GPU).
    vllm_config.scheduler_config.disable_hybrid_kv_cache_manager = (
        options.disable_hybrid_kv_cache_manager or _gpu_disables_hma(vllm_config))
    return vllm_config


def _gpu_disables_hma(vllm_config: Any) -> bool:
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    return (vllm_config.model_config.attention_chunk_size is not None
            or not KVConnectorFactory.supports_hma_config(vllm_config.kv_transfer_config))


def _connector_class() -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )

    return OffloadingConnector


def _refuse_stateful(model_config: Any) -> None:
    text = model_config.hf_text_config
    layer_types = [str(t) for t in getattr(text, "layer_types", None) or ()]
    stateful = [t for t in layer_types if t in _STATEFUL]
    if stateful or model_config.is_hybrid or model_config.is_attention_free:
        count = (f"{len(stateful)} of its {len(layer_types)} layers keep" if stateful
                 else "its layers keep")
        raise UnsupportedModelError(
            f"{model_config.architecture}: {count} recurrent state (Mamba / linear "
            f"attention). vLLM {VLLM_VERSION} sizes those pages by the GPU attention backend "
            "it picks at start (attention pages padded to the state's), in KV tensors shared "
            "by groups of different page sizes, which tiercache's worker cannot address: "
            "not supported")


def _layer_specs(vllm_config: Any, pp_rank: int) -> dict[str, Any]:
    """Each decoder layer's ``KVCacheSpec`` on one pipeline stage, as its attention layer
    builds it (vllm's ``Attention.get_kv_cache_spec`` / ``MLAAttention.get_kv_cache_spec``)."""
    from vllm.distributed.utils import get_pp_indices
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec, MLAAttentionSpec, SlidingWindowSpec, get_kv_quant_mode,
    )

    model_config = vllm_config.model_config
    cache = vllm_config.cache_config
    total = model_config.get_total_num_hidden_layers()
    start, end = get_pp_indices(total, pp_rank, vllm_config.parallel_config.pipeline_parallel_size)
    dtype = _kv_torch_dtype(vllm_config)
    quant = get_kv_quant_mode(cache.cache_dtype)
    layer_types = list(getattr(model_config.hf_text_config, "layer_types", None) or
                       ["full_attention"] * total)
    window = model_config.get_sliding_window()
    specs: dict[str, Any] = {}
    for index in range(start, end):
        kind = _ATTENTION.get(str(layer_types[index]))
        if kind is None:
            raise UnsupportedModelError(
                f"{model_config.architecture}: layer {index} is {layer_types[index]!r}, not an "
                "attention layer tiercache knows how vLLM caches")
        name = f"model.layers.{index}.self_attn.attn"
        if model_config.use_mla:
            if kind == "sliding":
                raise UnsupportedModelError(f"{model_config.architecture}: sliding-window MLA "
                                            "layers are not supported")
            specs[name] = MLAAttentionSpec(
                block_size=cache.block_size, num_kv_heads=1, max_tp_shards=1,
                head_size=model_config.get_head_size(), dtype=dtype,
                cache_dtype_str=cache.cache_dtype, kv_quant_mode=quant)
            continue
        common = dict(block_size=cache.block_size,
                      num_kv_heads=model_config.get_num_kv_heads(vllm_config.parallel_config),
                      head_size=model_config.get_head_size(), dtype=dtype, kv_quant_mode=quant)
        if kind == "sliding" and window:
            specs[name] = SlidingWindowSpec(**common, sliding_window=int(window))
        else:
            specs[name] = FullAttentionSpec(**common)
    return specs


def _kv_torch_dtype(vllm_config: Any) -> Any:
    from vllm.utils.torch_utils import kv_cache_dtype_str_to_dtype

    return kv_cache_dtype_str_to_dtype(vllm_config.cache_config.cache_dtype,
                                       vllm_config.model_config)


def _kind(spec: Any) -> str:
    from vllm.v1.kv_cache_interface import MLAAttentionSpec, SlidingWindowSpec

    if isinstance(spec, MLAAttentionSpec):
        return "mla"
    return "sliding" if isinstance(spec, SlidingWindowSpec) else "full"


class _ProbeSpec:
    """Stands where an ``OffloadingSpec`` stands for vLLM's connector worker: it keeps the
    ``CanonicalKVCaches`` the worker registers instead of attaching to a region."""

    replicated_layout = False

    def __init__(self, config: Any):
        self.config = config
        self.kv_caches: Any = None

    def get_worker(self, kv_caches: Any) -> Any:
        self.kv_caches = kv_caches
        return None

    def geometry(self, world_size: int) -> EngineGeometry:
        from tiercache.vllm.worker import canonical_geometry

        tokens = {g.tokens_per_block for g in self.config.groups}
        if len(tokens) != 1:
            raise UnsupportedModelError(
                f"its offloaded KV groups use {sorted(tokens)} tokens per block; tiercache "
                "needs one block size across them")
        geometry, _ = canonical_geometry(
            self.kv_caches, world_size=world_size,
            blocks_per_chunk=self.config.cache.blocks_per_chunk,
            block_tokens=tokens.pop() // max(self.config.parallel.dcp_size, 1))
        return geometry


@contextmanager
def _quiet_vllm() -> Iterator[None]:
    """vLLM logs its configuration on import and build, and warns of the GPU kernels a
    CPU-only host lacks, and logs what it then raises, which is reported as one line: the
    command prints a config, or that line."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "CRITICAL")
    loggers = [logging.getLogger(n) for n in ("vllm", "torch")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    for line in text.splitlines():
        if "error" in line.lower() and "validation error" not in line.lower():
            return line.strip()
    return text.splitlines()[0] if text else type(error).__name__
