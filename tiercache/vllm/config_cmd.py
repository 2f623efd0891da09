"""``tiercache config-for-vllm``: print the coordinator config a vLLM engine fits.

The geometry is vLLM's own answer for the model (``tiercache.vllm.model_kv``: vLLM 0.33's
KV-cache specs, its planner and its offloading connector's registration), so it is what the
engine's workers announce at attach: full attention, sliding-window hybrids (one KV-cache
group per attention type), MLA and fp8 KV alike; models tiercache cannot serve are refused
in one line naming why. It needs vLLM: run it where the engine runs (its image or venv,
with tiercache installed). The node's flags (socket, pinning, exporter, disk, events,
cluster) make the printed file deployable as is.
"""

from __future__ import annotations

import argparse
import importlib.metadata

from tiercache.config.node_options import add_node_arguments, apply_node_arguments
from tiercache.errors import ConfigError
from tiercache.sizes import parse_size
from tiercache.vllm.geometry import coordinator_toml

VLLM_VERSION = "0.33.0"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiercache config-for-vllm",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="local model directory (or its config.json)")
    parser.add_argument("--name", required=True, help="the coordinator's instance name")
    parser.add_argument("--capacity", required=True, help="host memory for the cache, e.g. 64GiB")
    g = parser.add_argument_group("vLLM's serving flags (its own names)")
    g.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    g.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    g.add_argument("--block-size", type=int, default=16, help="vLLM's --block-size")
    g.add_argument("--kv-cache-dtype", default="auto", help="vLLM's --kv-cache-dtype")
    g.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="vLLM's flag: one KV-cache group for every layer")
    g.add_argument("--blocks-per-chunk", type=int, default=1,
                   help="kv_connector_extra_config blocks_per_chunk (GPU blocks per CPU block)")
    add_node_arguments(parser)
    return parser


def require_vllm() -> None:
    """One line when vLLM is missing or another version: this command asks vLLM."""
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            f"config-for-vllm asks vLLM {VLLM_VERSION} for the model's KV layout, and vLLM is "
            "not installed here: run it in the engine's environment (its image or venv, "
            "with tiercache installed)") from None
    if version.split("+")[0] != VLLM_VERSION:
        raise ConfigError(f"config-for-vllm serves vLLM {VLLM_VERSION}; this environment has "
                          f"vLLM {version}")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    capacity = parse_size(args.capacity, "--capacity")
    require_vllm()
    from tiercache.vllm.model_kv import ServingOptions, model_kv

    kv = model_kv(args.model, ServingOptions(
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size, block_size=args.block_size,
        kv_cache_dtype=args.kv_cache_dtype, blocks_per_chunk=args.blocks_per_chunk,
        disable_hybrid_kv_cache_manager=args.disable_hybrid_kv_cache_manager))
    config = apply_node_arguments(kv.geometry.config(args.name, capacity), args)
    print(coordinator_toml(kv.geometry, config, kv.summary), end="")
    return 0
