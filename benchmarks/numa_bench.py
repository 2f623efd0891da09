"""Issue 34's measurement in one command: rank slices in their GPU's NUMA node on an
N-GPU, two-socket host (GPU machine; ``--device cpu`` runs the same plumbing anywhere).

Writes into OUT_DIR: the host's topology (``nvidia-smi topo -m``, ``numactl -H`` or the
sysfs node list where numactl is missing, the GPUs' PCI ids and links), the plain pinned
copy ceilings on N GPUs at once with host buffers placed local and remote
(benchmarks/numa_copy_ceiling.py), ``tiercache demo --bench --ranks N`` with
``region.numa_placement`` on and off (each its own coordinator, so each its own region
and fallocate), and report.md: per direction the aggregate of each run against the
local-placement ceiling (target >= 0.9 with placement on), the ranks' placement (node,
local fraction) and the wrong blocks (target 0).

    PYTHONPATH=. python3 benchmarks/numa_bench.py OUT_DIR [--ranks 8] [--requests 200]
        [--bench-blocks 256] [--bench-reps 20] [--capacity 32GiB] [--device cuda]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tiercache.config import PinningPolicy, config_to_toml, load_config
from tiercache.numa.topology import HostTopology
from tiercache.sizes import parse_size

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
TARGET = 0.9
DIRECTIONS = ("gpu_to_cpu", "cpu_to_gpu")


def _run(out: Path, name: str, argv: list[str], timeout_s: int) -> int:
    """Run ``argv`` with its output in OUT/name.log (and the tail on stderr)."""
    print(f"numa_bench: {' '.join(argv)}", file=sys.stderr, flush=True)
    with open(out / f"{name}.log", "w") as log:
        try:
            rc = subprocess.run(argv, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s,
                                cwd=REPO, check=False).returncode
        except (FileNotFoundError, subprocess.TimeoutExpired) as e:
            log.write(f"\n{e}\n")
            rc = 127 if isinstance(e, FileNotFoundError) else 124
    tail = (out / f"{name}.log").read_text().splitlines()[-3:]
    print("\n".join(f"  {line}" for line in tail), file=sys.stderr)
    return rc


def topology(out: Path) -> None:
    if shutil.which("nvidia-smi"):
        _run(out, "nvidia-smi-topo", ["nvidia-smi", "topo", "-m"], 60)
        query = ("--query-gpu=index,name,pci.bus_id,driver_version,pcie.link.gen.current,"
                 "pcie.link.width.current")
        _run(out, "gpus", ["nvidia-smi", query, "--format=csv"], 60)
    if shutil.which("numactl"):
        _run(out, "numactl", ["numactl", "-H"], 60)
    else:  # the same facts from sysfs: each node's CPUs and memory
        lines = ["numactl is not installed; from /sys/devices/system/node:"]
        for node in sorted(Path("/sys/devices/system/node").glob("node[0-9]*")):
            cpus = (node / "cpulist").read_text().strip()
            mem = next((line.split()[-2] for line in (node / "meminfo").read_text().splitlines()
                        if "MemTotal:" in line), "?")
            lines.append(f"{node.name}: cpus {cpus}; MemTotal {mem} kB")
        (out / "numactl.log").write_text("\n".join(lines) + "\n")
    host = HostTopology.read()
    (out / "sysfs_topology.json").write_text(json.dumps(dataclasses.asdict(host), indent=1))


def demo_config(out: Path, placement: bool, ranks: int, capacity: str, device: str) -> Path:
    base = load_config(REPO / "configs/demo-gpu.toml")
    region = dataclasses.replace(base.region, numa_placement=placement,
                                 capacity_bytes=parse_size(capacity, "--capacity"),
                                 num_blocks=None)
    if device == "cpu":  # host tensors cannot pin: the plumbing runs, the figures mean little
        region = dataclasses.replace(region, pinning=PinningPolicy.ALLOW_UNPINNED)
    config = dataclasses.replace(base, name=f"numa-bench-{os.getpid()}-{int(placement)}",
                                 world_size=ranks, region=region)
    path = out / f"demo_numa_{'on' if placement else 'off'}.toml"
    path.write_text(config_to_toml(config))
    return path


def _slice(numa: dict) -> str:
    ratio = numa["local_ratio"]
    there = "" if ratio is None else f", {ratio:.3f} of its pages there"
    return f"r{numa['rank']} {numa['state']} (node {numa['node']}{there})"


def report(out: Path) -> str:
    def load(name: str) -> dict | None:
        path = out / name
        return json.loads(path.read_text()) if path.exists() else None

    ceilings = {p: load(f"ceiling_{p}.json") for p in ("local", "remote")}
    demos = {p: load(f"demo_numa_{p}.json") for p in ("on", "off")}
    lines = ["# Issue 34: rank slices in their GPU's NUMA node", ""]
    lines += ["| | " + " | ".join(DIRECTIONS) + " |", "|---|---|---|"]
    ceiling = ceilings["local"]
    for p, doc in ceilings.items():
        if doc is None:
            lines.append(f"| plain pinned copies, {p}: not run | | |")
            continue
        for phase, label in (("gpu0_alone", "GPU 0 alone"), ("all", f"{doc['gpus']} GPUs")):
            cells = [f"{doc['phases'][phase][d]['gbps']:.1f} GB/s" for d in DIRECTIONS]
            lines.append(f"| plain pinned copies, host buffers {p}, {label} | "
                         + " | ".join(cells) + " |")
    for p, doc in demos.items():
        if doc is None or not doc.get("bench"):
            lines.append(f"| tiercache demo, placement {p}: not run | | |")
            continue
        cells = []
        for d in DIRECTIONS:
            gbps = doc["bench"]["directions"][d]["all"]["gbps"]
            ratio = (f" = {gbps / ceiling['phases']['all'][d]['gbps']:.3f} x local ceiling"
                     if ceiling else "")
            cells.append(f"{gbps:.1f} GB/s{ratio}")
        lines.append(f"| tiercache demo --bench, {doc['world_size']} ranks, placement {p} | "
                     + " | ".join(cells) + " |")
    lines.append("")
    for p, doc in demos.items():
        if doc is None:
            continue
        placed = ", ".join(_slice(n) for n in doc.get("numa", []))
        lines.append(f"* placement {p}: {doc['mismatched_blocks']} wrong of "
                     f"{doc['checked_blocks']} loaded blocks checked; {doc['failed_jobs']} "
                     f"failed jobs; slices: {placed}")
    lines.append(f"* target: >= {TARGET} of the {ceiling['gpus'] if ceiling else 'N'}-GPU "
                 "local ceiling per direction with placement on, 0 wrong blocks")
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--bench-blocks", type=int, default=256)
    ap.add_argument("--bench-reps", type=int, default=20)
    ap.add_argument("--capacity", default="32GiB", help="region capacity, all ranks")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    args = ap.parse_args()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    topology(out)
    failed = []
    if args.device == "cuda":
        for p in ("local", "remote"):
            if _run(out, f"ceiling_{p}", [sys.executable, str(HERE / "numa_copy_ceiling.py"),
                                          "--gpus", str(args.ranks), "--placement", p,
                                          "--json", str(out / f"ceiling_{p}.json")], 900):
                failed.append(f"ceiling {p}")
    for placement in (True, False):
        tag = "on" if placement else "off"
        config = demo_config(out, placement, args.ranks, args.capacity, args.device)
        if _run(out, f"demo_numa_{tag}", [
                sys.executable, "-m", "tiercache", "demo", "--config", str(config),
                "--ranks", str(args.ranks), "--device", args.device, "--quiet",
                "--requests", str(args.requests), "--bench", "--bench-blocks",
                str(args.bench_blocks), "--bench-reps", str(args.bench_reps),
                "--json", str(out / f"demo_numa_{tag}.json")], 1800):
            failed.append(f"demo placement {tag}")
    text = report(out)
    (out / "report.md").write_text(text)
    print(text)
    if failed:
        print(f"numa_bench: failed: {', '.join(failed)} (logs in {out})", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
