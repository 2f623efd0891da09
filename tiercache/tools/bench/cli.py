"""``tiercache bench`` arguments: which backends, page sizes and figures."""

from __future__ import annotations

import argparse

from tiercache.backends import HOST_KINDS
from tiercache.backend_kind import BackendKind
from tiercache.errors import ConfigError
from tiercache.tools.bench.report import format_report
from tiercache.tools.bench.rig import BenchBackend
from tiercache.tools.bench.workloads import DEFAULT_PAGE_KIB, DEFAULT_TENSORS

GPU_DEFAULT = tuple(BenchBackend.parse(k.label) for k in
                    (BackendKind.AUTO, BackendKind.CE, BackendKind.STAGED, BackendKind.KERNEL))
DESCRIPTION = (
    "Measure how fast each copy backend moves KV pages on this machine, against the same "
    "run's ceiling (one large pinned copy): store, load and both-ways rates per page size, "
    "one-block latency, host submit time, and optionally a matmul's speed beside the copies. "
    "Progress goes to stderr, the table to stdout.")


def _backend(text: str) -> BenchBackend:
    try:
        return BenchBackend.parse(text)
    except ConfigError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    gpu_default = " ".join(b.label for b in GPU_DEFAULT)
    gpu_kinds = ", ".join(k.label for k in BackendKind if k.configurable and k not in HOST_KINDS)
    p = argparse.ArgumentParser(prog="tiercache bench", description=DESCRIPTION)
    p.add_argument("--backend", nargs="+", type=_backend, default=None, metavar="NAME",
                   help=f"backends to measure: config names ({gpu_kinds}; cpu runs alone, "
                        "on host memory only) or variants (ce-stream: loads "
                        "with srcAccessOrder STREAM; staged-python: staged issued from Python on "
                        "the caller's thread, without the native chunk loop; "
                        "staged-CHUNKMIB-SLOTS, e.g. staged-32-2: "
                        f"another staging ring). Default: {gpu_default} with CUDA, else cpu")
    p.add_argument("--page-kib", nargs="+", type=float, default=list(DEFAULT_PAGE_KIB),
                   metavar="KIB", help="page sizes to sweep, in KiB; each keeps 512 MiB per "
                   "transfer (cpu: --cpu-transfer-mib). Default: %(default)s")
    p.add_argument("--tensors", type=int, default=DEFAULT_TENSORS, metavar="N",
                   help="at most this many KV tensors (layers x K, V) per rank; large pages "
                        "use fewer. Default: %(default)s")
    p.add_argument("--reps", type=int, default=5, metavar="N",
                   help="timed repetitions per figure (after warm-up); rates are medians, the "
                        "ceiling the best of twice as many. Default: %(default)s")
    p.add_argument("--pattern-steps", type=int, default=40, metavar="N",
                   help="engine-pattern steps per order (store first, load first): store and "
                        "load back to back from one thread with another Python thread busy; "
                        "host time and one-block latency as p50/p99 (0: skip). "
                        "Default: %(default)s")
    p.add_argument("--matmul", action="store_true",
                   help="also measure a bf16 8192^3 matmul alone and beside continuous "
                        "both-ways copies of the 32 KiB workload")
    p.add_argument("--matmul-backends", nargs="+", type=_backend, default=list(GPU_DEFAULT),
                   metavar="NAME", help=f"backends for --matmul. Default: {gpu_default}")
    p.add_argument("--matmul-iters", type=int, default=40, metavar="N",
                   help="matmuls per timed run for --matmul. Default: %(default)s")
    p.add_argument("--device", type=int, default=0, metavar="ORDINAL",
                   help="CUDA device ordinal to measure. Default: %(default)s")
    p.add_argument("--cpu-transfer-mib", type=int, default=64, metavar="MIB",
                   help="bytes per transfer for --backend cpu, in MiB. Default: %(default)s")
    p.add_argument("--json", metavar="FILE", help="also write every figure to FILE as JSON")
    return p


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.backend is None:
        args.backend = list(GPU_DEFAULT) if _cuda_available() else [_backend("cpu")]
    on_host = [b for b in args.backend if b.kind in HOST_KINDS]
    if on_host and len(args.backend) > 1:
        parser.error("--backend cpu runs alone (it measures host memory only)")
    if on_host:
        from tiercache.tools.bench.host import run_cpu

        report = run_cpu(args)
    else:
        from tiercache.tools.bench.figures import run_gpu

        report = run_gpu(args)
    print(format_report(report))
    if args.json:
        report.write_json(args.json)
    return 0
