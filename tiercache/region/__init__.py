"""The shared-memory region: layout arithmetic, header, per-rank stats blocks, host memory and pinning."""
