"""The shared-memory region (foundation: both wings map it; it imports neither).

``layout`` (pure arithmetic: header, stats blocks, ledger, slices, rows, registration
ranges), ``header`` (the region's identity and state), ``stats`` (per-rank stats blocks),
``ledger`` and ``sessions`` (the durable index and session tables, ``checksum`` for their
records), ``hostmem`` (space checks, pre-faulting, process liveness), ``shm`` (the POSIX
object, opened and checked as ours), ``shared`` (one mapping: create, re-adopt, attach,
views, page-lock a slice with the worker's registrar), ``placement`` (each rank's slice in
its device's NUMA node: bound before fallocate, counted and moved around the worker's
pre-fault), ``claim`` (taking a stale region's
name over), ``names`` (a region found by instance name), ``attachments`` (attachment
slots per rank), ``presence`` (the key presence map) and ``stale`` (finding and removing
stale regions).
"""
