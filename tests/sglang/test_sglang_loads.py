"""What loads in an SGLang rank's process with tiercache's HiCache backend
(``process_loads``): the backend, its control client and its region link load nothing of
the coordinator (no index, no tiers, no event publisher, no control server). Run in
.venv-sglang, where SGLang is installed."""

from __future__ import annotations

from sglang_env import STUBS, require_sglang

require_sglang()

import sys  # noqa: E402

from process_loads import SGLANG_BACKEND, loaded  # noqa: E402

# SGLang's own modules the backend imports, loaded first: what they bring is SGLang's
SGLANG_BASELINE = [
    "torch", "sglang.srt.mem_cache.hicache_storage",
    "sglang.srt.observability.metrics_collector", "sglang.srt.runtime_context",
]


def test_the_backend_loads_nothing_of_the_coordinator():
    found = loaded(["tiercache.sglang:TierCacheHiCacheStorage"], SGLANG_BASELINE,
                   sys.executable, path=[STUBS])
    assert {"tiercache.sglang.storage", "tiercache.link.client",
            "tiercache.transfer.host_transfer"} <= found.tiercache
    assert not SGLANG_BACKEND.breaches(found)
