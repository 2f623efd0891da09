"""What an SGLang 0.5.23 rank's host pool hands tiercache for a model, asked of SGLang itself.

``tiercache config-for-sglang`` sizes a region from this, so the printed config and the
backend's attach check (``PoolGeometry`` from the pool's ``get_page_buffer_meta``) cannot
disagree: SGLang's ``ModelConfig`` reads the model (KV heads per TP rank, head size, MLA's
latent, layers, dtype), SGLang's own device pool and host pool classes are built on the CPU
for a few pages in the chosen ``--hicache-mem-layout``, and tiercache's ``PoolPages`` reads
a page's blobs from them, as the backend does at attach.

Refused in one line (``UnsupportedModelError``): models SGLang runs on hybrid pools
(sliding-window layers in an SWA pool, Mamba / linear-attention state): tiercache's SGLang
backend serves one MHA or MLA host pool. Needs SGLang (and torch): run it in the engine's
environment.
"""

from __future__ import annotations

import contextlib
import io
import logging
import warnings
from typing import Any

from tiercache.config.hf_model import HFModel
from tiercache.errors import ConfigError, UnsupportedModelError
from tiercache.sglang.geometry import PoolGeometry

SGLANG_VERSION = "0.5.23"
PROBE_PAGES = 4  # device pool pages; the host pool holds twice as many (only the layout matters)
KV_CACHE_DTYPES = {"auto": None, "bf16": "bfloat16", "bfloat16": "bfloat16",
                   "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def sglang_pool(model: str, *, tp_size: int = 1, page_size: int = 64,
                layout: str = "page_first_direct", kv_cache_dtype: str = "auto"
                ) -> tuple[str, PoolGeometry]:
    """(architecture, rank 0's pool geometry) for the model under SGLang's flags."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"--kv-cache-dtype {kv_cache_dtype!r}: allowed "
                          f"{', '.join(KV_CACHE_DTYPES)}")
    for flag, value in (("--tp-size", tp_size), ("--page-size", page_size)):
        if value < 1:
            raise ConfigError(f"{flag} {value}: must be >= 1")
    directory = HFModel.read(model).path.parent  # missing, not JSON, not a decoder: one line
    with _quiet():
        return _sglang_pool(str(directory), tp_size, page_size, layout, kv_cache_dtype)


def _sglang_pool(directory: str, tp_size: int, page_size: int, layout: str,
                 kv_cache_dtype: str) -> tuple[str, PoolGeometry]:
    import torch
    from sglang.srt.configs.model_config import AttentionArch, ModelConfig

    try:
        config = ModelConfig(model_path=directory, trust_remote_code=False)
    except Exception as e:  # SGLang's and transformers' own errors: one line
        raise ConfigError(f"SGLang {SGLANG_VERSION} cannot read the model at {directory!r}: "
                          f"{str(e).strip().splitlines()[0] if str(e).strip() else e!r}"
                          ) from None
    architecture = config.hf_config.architectures[0]
    _refuse_hybrid(config, architecture)
    is_mla = config.attention_arch == AttentionArch.MLA
    named = KV_CACHE_DTYPES[kv_cache_dtype]
    dtype = config.dtype if named is None else getattr(torch, named)
    if not is_mla:
        total = config.get_total_num_kv_heads()
        if total >= tp_size and total % tp_size:
            raise ConfigError(f"{total} KV heads do not split evenly over --tp-size {tp_size}")
    host = _host_pool(config, is_mla, tp_size, page_size, layout, dtype)
    from tiercache.sglang.pool_pages import PoolPages

    pages = PoolPages(host)
    geometry = PoolGeometry(layout=layout, kv_dtype=str(dtype).removeprefix("torch."),
                            page_size=pages.page_size, blob_bytes=pages.blob_bytes,
                            tp_size=tp_size, tp_rank=0, is_mla=is_mla)
    return architecture, geometry


def _refuse_hybrid(config: Any, architecture: str) -> None:
    from sglang.srt.configs.hybrid_arch import hybrid_gdn_config, mamba2_config

    if hybrid_gdn_config(config) is not None or mamba2_config(config) is not None or \
            config.linear_attn_registry_result is not None:
        kind = "Mamba / linear-attention state"
    elif config.is_hybrid_swa:
        kind = "sliding-window layers in an SWA pool"
    else:
        return
    raise UnsupportedModelError(
        f"{architecture}: SGLang {SGLANG_VERSION} runs it on hybrid pools ({kind}); "
        "tiercache's SGLang backend serves one MHA or MLA host pool: not supported")


def _host_pool(config: Any, is_mla: bool, tp_size: int, page_size: int, layout: str,
               dtype: Any) -> Any:
    """SGLang's own device and host pool for a few pages, as one TP rank builds them."""
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost
    from sglang.srt.runtime_context import get_parallel

    get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0, tp_rank=0,
                                        tp_size=tp_size, pp_rank=0, pp_size=1)
    tokens = PROBE_PAGES * page_size
    layers = config.num_hidden_layers
    # SGLang's MLA host pool indexes its first dimension by layer when it builds its
    # per-layer views, whatever the layout: it needs at least as many host pages as layers
    # (a production pool has far more)
    ratio = max(2.0, (layers + 1) / PROBE_PAGES)
    try:
        if is_mla:
            device = MLATokenToKVPool(
                size=tokens, page_size=page_size, dtype=dtype, kv_lora_rank=config.kv_lora_rank,
                qk_rope_head_dim=config.qk_rope_head_dim, layer_num=layers, device="cpu",
                enable_memory_saver=False)
            return MLATokenToKVPoolHost(
                device.get_device_pool_infos()[0].buffer_info, ratio, 0, page_size, layout,
                pin_memory=False, device_capacity_tokens=tokens,
                start_layer=device.start_layer, end_layer=device.end_layer,
                target_layer_num=layers, override_kv_cache_dim=device.kv_cache_dim)
        device = MHATokenToKVPool(
            size=tokens, page_size=page_size, dtype=dtype,
            head_num=config.get_num_kv_heads(tp_size), head_dim=config.head_dim,
            layer_num=layers, device="cpu", enable_memory_saver=False)
        cls, info, kw = _mha_host_inputs(device)
        return cls(info, 2.0, 0, page_size, layout, pin_memory=False, **kw)
    except (ValueError, AssertionError, NotImplementedError) as e:
        raise ConfigError(f"SGLang {SGLANG_VERSION} cannot build a host pool with "
                          f"--hicache-mem-layout {layout} for this model: {e}") from None


@contextlib.contextmanager
def _quiet() -> Any:
    """SGLang warns on import about the GPU kernels a CPU-only host lacks; the command prints
    a config, or one error line."""
    logger = logging.getLogger("sglang")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logger.setLevel(level)
