"""``tiercache config-for-sglang``: print the coordinator config SGLang engines of a model fit.

From a model's Hugging Face ``config.json`` (a local model directory or the file) and
SGLang's own flag names (``--tp-size``, ``--page-size``, ``--hicache-mem-layout``,
``--kv-cache-dtype``), the page one SGLang TP rank's host pool hands the storage backend:
``layers x page x kv_heads/TP x head_dim x dtype`` bytes for K and as many for V (MLA,
e.g. DeepSeek: one latent blob of ``layers x page x (kv_lora_rank + qk_rope_head_dim)``).
The region has one rank whose rows hold one rank's page; every TP rank process is an
attachment of it (``tiercache.sglang.geometry``). No SGLang import: this runs on the
coordinator's host.
"""

from __future__ import annotations

import argparse

from tiercache.config.hf_model import HFModel
from tiercache.errors import ConfigError
from tiercache.sglang.geometry import LAYOUTS, SGLangModelShape, coordinator_toml
from tiercache.sizes import parse_size

# SGLang's --kv-cache-dtype values whose pages tiercache can size (no float16: fp16 KV
# follows a float16 model's own dtype under "auto")
KV_CACHE_DTYPES = {"auto": None, "bf16": "bfloat16", "bfloat16": "bfloat16",
                   "fp8_e4m3": "fp8", "fp8_e5m2": "fp8"}
DEFAULT_PAGE_SIZE = 64


def shape_from_hf_config(path: str, kv_cache_dtype: str = "auto") -> SGLangModelShape:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ConfigError(f"--kv-cache-dtype {kv_cache_dtype!r}: allowed "
                          f"{', '.join(KV_CACHE_DTYPES)}")
    model = HFModel.read(path)
    dtype = KV_CACHE_DTYPES[kv_cache_dtype] or model.dtype()
    hf = model.fields
    if "kv_lora_rank" in hf:  # MLA: one latent per token and layer, the same on every rank
        latent = int(hf["kv_lora_rank"]) + int(hf.get("qk_rope_head_dim", 0))
        return SGLangModelShape(model.num_layers, 1, latent, dtype, is_mla=True)
    kv_heads, head_dim = model.kv_heads_and_head_dim
    return SGLangModelShape(model.num_layers, kv_heads, head_dim, dtype)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiercache config-for-sglang",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="local model directory (or its config.json)")
    parser.add_argument("--name", required=True, help="the coordinator's instance name")
    parser.add_argument("--capacity", required=True, help="host memory for the cache, e.g. 64GiB")
    parser.add_argument("--tp-size", type=int, default=1, help="SGLang's --tp-size")
    parser.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE,
                        help=f"SGLang's --page-size (default {DEFAULT_PAGE_SIZE})")
    parser.add_argument("--hicache-mem-layout", default="page_first_direct", choices=LAYOUTS,
                        help="SGLang's --hicache-mem-layout (the page's bytes, not its size)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                        help="SGLang's --kv-cache-dtype")
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    shape = shape_from_hf_config(args.model, args.kv_cache_dtype)
    pool = shape.pool(page_size=args.page_size, tp_size=args.tp_size,
                      layout=args.hicache_mem_layout)
    print(coordinator_toml(pool, args.name, parse_size(args.capacity, "--capacity")), end="")
    return 0
