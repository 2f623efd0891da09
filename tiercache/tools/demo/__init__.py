"""``tiercache demo``: an engine-shaped workload over a real coordinator and real workers.

Modules, in the order data flows: ``workload`` (prefix-reuse requests and their block
keys) → ``engine`` (the scheduler: index calls through ``Client``, one job per
direction to every rank, completions through ``tiercache.link.jobs``) → ``channel`` / ``wire``
(a pipe per rank, fixed binary records) → ``rank`` (a worker process around
``tiercache.attach``) → ``content`` (what each block must hold, at every rank).
``report`` counts and prints; ``bench`` measures aggregate bandwidth; ``run`` is the CLI.
"""

from tiercache.tools.demo.run import main

__all__ = ["main"]
