"""What a tiercache engine adds to vLLM's metrics: the metric names (``TierCacheMetrics``),
their definitions (``metric_definitions``, which vLLM asks the spec class for before any
manager exists) and the static facts on ``vllm:kv_offload_config_info``
(``TierCacheInfo``). The scheduler's manager reports them; the spec declares them."""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.kv_offload.base import (
    ConfigInfo,
    OffloadingCounterMetadata,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingMetricMetadata,
)


class TierCacheMetrics:
    """Metric names (declared in ``TierCacheOffloadingSpec.build_metric_definitions``)."""

    COORDINATOR_UP = "vllm:kv_offload_tiercache_coordinator_up"
    LEASED_CHUNKS = "vllm:kv_offload_tiercache_leased_chunks"
    PROBED_KEYS = "vllm:kv_offload_tiercache_probed_keys"
    LOADED_CHUNKS = "vllm:kv_offload_tiercache_loaded_chunks"
    STORES_SKIPPED = "vllm:kv_offload_tiercache_stores_skipped"
    FLUSH_SECONDS = "vllm:kv_offload_tiercache_flush_seconds"
    COLD_MISSES = "vllm:kv_offload_tiercache_cold_misses"


@dataclass(frozen=True)
class TierCacheInfo(ConfigInfo):
    """Static facts on ``vllm:kv_offload_config_info``."""

    tiercache_instance: str
    tiercache_namespace: str
    tiercache_region_chunks: int


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """vLLM's declarations of ``TierCacheMetrics`` (asked for by the spec class)."""
    return {
        TierCacheMetrics.COORDINATOR_UP: OffloadingGaugeMetadata(
            "1 while this engine's tiercache coordinator answers, 0 while it is gone "
            "(lookups then miss and stores are skipped)"),
        TierCacheMetrics.LEASED_CHUNKS: OffloadingGaugeMetadata(
            "Chunks this engine holds a lease on in the tiercache coordinator "
            "(pinned for hits not yet loaded and loads in flight)"),
        TierCacheMetrics.PROBED_KEYS: OffloadingCounterMetadata(
            "Keys sent to the tiercache coordinator in the per-step batched lookup"),
        TierCacheMetrics.LOADED_CHUNKS: OffloadingCounterMetadata(
            "Chunks this engine loaded from tiercache (from its leases; the "
            "coordinator's loaded_blocks does not count them)"),
        TierCacheMetrics.COLD_MISSES: OffloadingCounterMetadata(
            "New requests answered MISS at their first lookup from the coordinator's key "
            "presence map (no tier holds their first chunk): admitted in that step, with "
            "no round trip"),
        TierCacheMetrics.STORES_SKIPPED: OffloadingCounterMetadata(
            "Chunks not offloaded because the tiercache coordinator was gone"),
        TierCacheMetrics.FLUSH_SECONDS: OffloadingHistogramMetadata(
            "Seconds per step to send lookups, releases and completions to the tiercache "
            "coordinator (off the scheduler's critical path)",
            buckets=(1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0)),
    }
