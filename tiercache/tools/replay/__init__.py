"""``tiercache replay`` (issue 40): real vLLM schedulers over a request trace, compared per
system (no offloading, vLLM's own CPU offloading, tiercache) on a simulated clock.

Modules, in the order a replay uses them: ``trace`` (the JSONL format), ``workloads`` (the
built-in generators), ``cost`` (the clock's cost model), ``worker`` and ``engine`` (one
replayed engine), ``systems`` (each system's engines), ``events`` and ``routers``,
``clock`` (the discrete-event loop), ``report``, ``cli``.
"""

from __future__ import annotations


def main(argv: list[str]) -> int:
    from tiercache.tools.replay.cli import main as replay_main

    return replay_main(argv)
