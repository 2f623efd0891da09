"""What loads in vLLM's two processes (``process_loads``), each as vLLM builds it: the
scheduler (the spec, its manager, the control client it connects with) loads nothing of
the coordinator and nothing of the worker wing; a worker (the spec and its worker) loads
nothing of the coordinator, the control plane or the scheduler's lease book. Run in
.venv-vllm, where vLLM is installed."""

from __future__ import annotations

from vllm_env import require_vllm

require_vllm()

import sys  # noqa: E402

from process_loads import VLLM_SCHEDULER, VLLM_WORKER, loaded  # noqa: E402

# vLLM's own modules the adapter imports, loaded first: what they bring (pyzmq among it)
# is vLLM's, not tiercache's
VLLM_BASELINE = [
    "vllm.v1.kv_offload.base", "vllm.v1.kv_offload.config", "vllm.v1.metrics.cache_hit_source",
    "vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics",
]


def test_the_scheduler_loads_neither_the_coordinator_nor_the_worker_wing():
    found = loaded(["tiercache.vllm:TierCacheOffloadingSpec", "tiercache.vllm.manager",
                    "tiercache.link.client"], VLLM_BASELINE, sys.executable)
    assert {"tiercache.vllm.manager", "tiercache.link.client"} <= found.tiercache
    assert not VLLM_SCHEDULER.breaches(found)


def test_a_worker_loads_neither_the_coordinator_nor_the_scheduler_s_side():
    found = loaded(["tiercache.vllm:TierCacheOffloadingSpec", "tiercache.vllm.worker"],
                   VLLM_BASELINE, sys.executable)
    assert "tiercache.transfer.worker" in found.tiercache
    assert not VLLM_WORKER.breaches(found)
