"""NUMA placement of the region's rank slices (foundation, below ``region``: the coordinator
binds slices before it allocates them, each worker checks and completes its own).

* ``topology``: the host's memory nodes and its GPUs' nodes, from sysfs under a root path;
  the node each rank's slice is bound to before ``posix_fallocate``.
* ``mempolicy``: ``mbind`` / ``get_mempolicy`` / ``move_pages`` through ctypes.
* ``placement``: ``NumaState`` and ``NumaPlacement``, what a worker's stats block records.

The order of events and its reasons: docs/architecture-notes.md, "Rank slices in their
GPU's NUMA node"; the worker's part: ``tiercache.region.placement``.
"""
