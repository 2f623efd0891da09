"""``tiercache config-for-vllm``: print the coordinator config a vLLM engine fits.

From a model's Hugging Face ``config.json`` (a local path: a model directory or the file)
and vLLM's serving options, the per-rank geometry vLLM 0.33's offloading connector will
announce under its default per-layer (LBHNC) KV layout: one page per layer per rank of
``2 x kv_heads/TP x block_size x head_dim x dtype`` bytes, ``TP x PP`` ranks. For models
whose layers are all full attention with K and V (Llama, Qwen, Mistral, ...); for others
(MLA, hybrid, sliding window) start the engine against any region and copy the geometry
from the mismatch error, which names what the engine needs. No vLLM import: this runs on
the coordinator's host.
"""

from __future__ import annotations

import argparse

from tiercache.config import DTYPE_BYTES
from tiercache.config.hf_model import HFModel
from tiercache.sizes import parse_size
from tiercache.vllm.geometry import ModelShape, coordinator_toml

def shape_from_hf_config(path: str, kv_cache_dtype: str = "auto") -> ModelShape:
    model = HFModel.read(path)
    kv_heads, head_dim = model.kv_heads_and_head_dim
    if kv_cache_dtype == "auto":
        dtype = model.dtype()
    else:
        dtype = "fp8" if kv_cache_dtype.startswith("fp8") else kv_cache_dtype
    return ModelShape(model.num_layers, kv_heads, head_dim, dtype)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiercache config-for-vllm",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="local model directory (or its config.json)")
    parser.add_argument("--name", required=True, help="the coordinator's instance name")
    parser.add_argument("--capacity", required=True, help="host memory for the cache, e.g. 64GiB")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    parser.add_argument("--block-size", type=int, default=16, help="vLLM's --block-size")
    parser.add_argument("--blocks-per-chunk", type=int, default=1,
                        help="kv_connector_extra_config blocks_per_chunk (block_size / 16)")
    parser.add_argument("--kv-cache-dtype", default="auto",
                        choices=["auto", *sorted(DTYPE_BYTES), "fp8_e4m3", "fp8_e5m2"])
    return parser


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    shape = shape_from_hf_config(args.model, args.kv_cache_dtype)
    geometry = shape.geometry(block_tokens=args.block_size, tp_size=args.tensor_parallel_size,
                              pp_size=args.pipeline_parallel_size,
                              blocks_per_chunk=args.blocks_per_chunk)
    print(coordinator_toml(geometry, args.name, parse_size(args.capacity, "--capacity")), end="")
    return 0
