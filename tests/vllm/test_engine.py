"""vLLM's own Scheduler and OffloadingConnector (both roles) with TierCacheOffloadingSpec,
a real `tiercache serve`, CPU KV tensors and the cpu backend."""

from __future__ import annotations

from vllm_env import require_vllm

require_vllm()

import numpy as np  # noqa: E402
import pytest  # noqa: E402

from conftest import needs_sessions  # noqa: E402
from tiercache.region.shared import SharedOffloadRegion  # noqa: E402
from vllm_harness import BLOCK_TOKENS  # noqa: E402

PROMPT = list(range(100))  # 6 full blocks and a partial one
OTHER = [200 + (i % 50) for i in range(230)]  # takes every GPU block of a 16-block engine


def region_rows(coordinator, slots):
    """Each slot's row of rank 0, as the coordinator's region holds it now."""
    with SharedOffloadRegion.attach(coordinator.config.name) as region:
        rows = region.rank_array(0)
        return [rows[s].copy() for s in slots]


@needs_sessions
def test_a_stored_prefix_is_loaded_by_the_next_request_byte_for_byte(coordinator, make_engine):
    # 16 GPU blocks: the request in between evicts the first prompt's blocks from the GPU,
    # so the second request can only get its prefix from tiercache.
    engine = make_engine(coordinator, num_gpu_blocks=16)
    engine.add_request("r1", PROMPT)
    engine.run()
    stats = engine.manager.book
    assert not stats.writing, "request 1's stores completed"
    engine.add_request("between", OTHER)
    engine.run()
    engine.add_request("r2", PROMPT + [1, 2, 3])
    engine.run()

    assert engine.loaded_tokens("r2") == 6 * BLOCK_TOKENS
    (load,) = [r for r in engine.finished_loads if r.req_id == "r2"]
    rows = region_rows(coordinator, load.slots)
    page = engine.model.page_bytes
    for row, gpu_block in zip(rows, load.gpu_blocks):
        for layer in range(engine.model.num_layers):
            region_page = row[layer * page:(layer + 1) * page]  # page offsets: 256-aligned
            assert np.array_equal(engine.block_bytes(gpu_block, layer), region_page)
    assert engine.finished == {"r1", "between", "r2"}
