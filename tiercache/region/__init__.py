"""The shared-memory region: layout arithmetic, header, per-rank stats blocks, host memory
and pinning, the POSIX shared-memory object (shm), the mapped region (shared), and finding
and removing stale regions (stale)."""
