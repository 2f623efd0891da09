"""``tiercache config-for-sglang``: print the coordinator config SGLang engines of a model fit.

The page is SGLang's own answer for the model (``tiercache.sglang.model_pool``: SGLang
0.5.23's model config and its device and host pool classes, read through the pool's
``get_page_buffer_meta`` as the backend reads it at attach), under SGLang's flag names
(``--tp-size``, ``--page-size``, ``--hicache-mem-layout``, ``--kv-cache-dtype``). The region
has one rank whose rows hold one rank's page; every TP rank process is an attachment of it
(``tiercache.sglang.geometry``). Models SGLang runs on hybrid pools are refused in one line.
It needs SGLang: run it where the engine runs (its image or venv, with tiercache installed).
The node's flags (socket, pinning, exporter, disk, events, cluster) make the printed file
deployable as is.
"""

from __future__ import annotations

import argparse
import importlib.metadata

from tiercache.config.node_options import add_node_arguments, apply_node_arguments
from tiercache.errors import ConfigError
from tiercache.sglang.geometry import LAYOUTS, coordinator_toml
from tiercache.sizes import parse_size

SGLANG_VERSION = "0.5.23"
DEFAULT_PAGE_SIZE = 64
KV_CACHE_DTYPES = ("auto", "bf16", "bfloat16", "fp8_e4m3", "fp8_e5m2")  # SGLang's names


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tiercache config-for-sglang",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help="local model directory (or its config.json)")
    parser.add_argument("--name", required=True, help="the coordinator's instance name")
    parser.add_argument("--capacity", required=True, help="host memory for the cache, e.g. 64GiB")
    g = parser.add_argument_group("SGLang's serving flags (its own names)")
    g.add_argument("--tp-size", type=int, default=1, help="SGLang's --tp-size")
    g.add_argument("--page-size", type=int, default=DEFAULT_PAGE_SIZE,
                   help=f"SGLang's --page-size (default {DEFAULT_PAGE_SIZE})")
    g.add_argument("--hicache-mem-layout", default="page_first_direct", choices=LAYOUTS,
                   help="SGLang's --hicache-mem-layout (the page's bytes, not its size)")
    g.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="SGLang's --kv-cache-dtype")
    add_node_arguments(parser)
    return parser


def require_sglang() -> None:
    """One line when SGLang is missing or another version: this command asks SGLang."""
    try:
        version = importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            f"config-for-sglang asks SGLang {SGLANG_VERSION} for the model's host pool pages, "
            "and SGLang is not installed here: run it in the engine's environment (its "
            "image or venv, with tiercache installed)") from None
    if version != SGLANG_VERSION:
        raise ConfigError(f"config-for-sglang serves SGLang {SGLANG_VERSION}; this environment "
                          f"has SGLang {version}")


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    capacity = parse_size(args.capacity, "--capacity")
    require_sglang()
    from tiercache.sglang.model_pool import sglang_pool

    architecture, pool = sglang_pool(args.model, tp_size=args.tp_size, page_size=args.page_size,
                                     layout=args.hicache_mem_layout,
                                     kv_cache_dtype=args.kv_cache_dtype)
    config = apply_node_arguments(pool.config(args.name, capacity), args)
    print(coordinator_toml(pool, config, architecture), end="")
    return 0
