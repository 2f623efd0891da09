"""`tiercache serve`'s time to answer against its region's capacity (issue 41, item 1).

For each capacity, a real ``python -m tiercache serve`` child is started and timed from its
start (just before ``Popen``) to:

* ``answers``: the first ``stats`` call on its control socket that succeeds (polled every
  5 ms: what an engine waiting for the coordinator sees);
* ``reserved``: the region header saying the whole region is reserved (``Reservation.
  COMPLETE``; read with ``pread`` every 5 ms, as ``tiercache status`` reads it). A tree
  from before the background reservation reserves everything before it answers: there
  ``reserved`` is ``answers`` or earlier.

The coordinator is then stopped (SIGTERM) and its region removed before the next run; each
capacity runs ``--repeat`` times and the median is printed, with the load average.

    PYTHONPATH=. .venv/bin/python benchmarks/ready_time.py --capacities 1 8 16
    # the tree before: PYTHONPATH=/tmp/tc-before .venv/bin/python benchmarks/ready_time.py \\
    #   --tree /tmp/tc-before

Results: docs/benchmarks.md, "Instant on (issue 41, item 1)".
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

POLL_S = 0.005
TOML = """[instance]
name = "{name}"
world_size = 2
[region]
capacity = "{gib}GiB"
pinning = "allow_unpinned"
check_host_memory = false
[kv]
page_bytes = 32768
num_tensors = 8
[control]
socket = "{socket}"
[exporter]
enabled = false
"""


def _reserved(path: str) -> bool:
    """Whether the region's header says it is wholly reserved (this tree's header)."""
    from tiercache.region.header import Reservation
    from tiercache.region.shm import read_header

    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        info = read_header(fd)
    finally:
        os.close(fd)
    return info is not None and info.reservation == Reservation.COMPLETE


def run_once(gib: int, tree: str, workdir: Path) -> tuple[float, float]:
    try:
        from tiercache.link.client import Client
    except ModuleNotFoundError:  # a tree from before issue 38 (PYTHONPATH: the tree measured)
        from tiercache.control.client import Client
    from tiercache.errors import TiercacheError

    name = f"ready-bench-{os.getpid()}"
    socket = workdir / f"{name}.sock"
    config = workdir / f"{name}.toml"
    config.write_text(TOML.format(name=name, gib=gib, socket=socket))
    env = dict(os.environ, PYTHONPATH=tree)  # and cwd: `-m` puts the cwd first on sys.path
    region = f"/dev/shm/tiercache-{name}"
    log = (workdir / f"{name}.log").open("w")
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "tiercache", "serve", "--config", str(config)],
                            env=env, cwd=tree, stdout=log, stderr=subprocess.STDOUT)
    answers = reserved = None
    try:
        while answers is None or reserved is None:
            if proc.poll() is not None:
                raise SystemExit(f"serve exited {proc.returncode}: "
                                 f"{(workdir / f'{name}.log').read_text()}")
            now = time.perf_counter() - t0
            if answers is None and socket.exists():
                try:
                    with Client(str(socket), timeout_s=2.0) as client:
                        client.stats()
                    answers = time.perf_counter() - t0
                except (TiercacheError, OSError):
                    pass
            if reserved is None and _reserved(region):
                reserved = now
            time.sleep(POLL_S)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        log.close()
    return answers, max(reserved, 0.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--capacities", type=int, nargs="+", default=[1, 8, 16], help="GiB")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--tree", default=".", help="the checkout whose `serve` runs")
    args = parser.parse_args()
    print(f"tree {args.tree}; load average {os.getloadavg()[0]:.2f}; "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    print("capacity_gib  answers_s (median, runs)            reserved_s (median)")
    with tempfile.TemporaryDirectory(prefix="ready-bench-") as tmp:
        for gib in args.capacities:
            runs = [run_once(gib, args.tree, Path(tmp)) for _ in range(args.repeat)]
            answers = [a for a, _ in runs]
            reserved = [r for _, r in runs]
            print(f"{gib:>12}  {statistics.median(answers):6.2f} "
                  f"({', '.join(f'{a:.2f}' for a in answers)})"
                  f"    {statistics.median(reserved):6.2f}  load {os.getloadavg()[0]:.2f}",
                  flush=True)


if __name__ == "__main__":
    main()
