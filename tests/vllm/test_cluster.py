"""Two engines (vLLM's own Scheduler and OffloadingConnector, CPU KV tensors) on two
coordinators that share one real ``mooncake_master``: the second engine loads the first
engine's prefix from the cluster tier, byte for byte (the harness checks every loaded
block against the bytes the model computes for that prefix)."""

from __future__ import annotations

from vllm_env import require_vllm

require_vllm()

import pytest  # noqa: E402

from control_support import wait_for  # noqa: E402
from mooncake_master import MooncakeMaster  # noqa: E402
from vllm_harness import BLOCK_TOKENS  # noqa: E402


@pytest.fixture
def master(tmp_path):  # asked for before the coordinators: it outlives them
    with MooncakeMaster(tmp_path / "master") as m:
        yield m


def prompt(seed: int, length: int = 96) -> list[int]:
    return [(seed * 31 + i) % 250 for i in range(length)]


def cluster_stats(coordinator):
    from tiercache.link.client import Client

    with Client(coordinator.config) as client:
        return client.tier_stats()["cluster"]


def test_a_prefix_computed_on_node_a_is_loaded_on_node_b_byte_for_byte(master, start_coordinator,
                                                                       make_engine):
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    from tiercache.config import ClusterConfig

    cluster = ClusterConfig(master=master.address, metadata_server=master.metadata_url,
                            local_hostname="127.0.0.1", key_file=master.key_file,
                            segment_bytes=64 << 20,
                            exists_ttl_s=0.5, retry_s=0.5, start_timeout_s=10,
                            # the harness's steps take a few ms: wait for the pool's answer
                            # (2 cores and a full test run may make it slower than 50 ms)
                            exists_wait_s=5.0)
    node_a = start_coordinator(suffix="a", cluster=cluster)
    node_b = start_coordinator(suffix="b", cluster=cluster)
    first = make_engine(node_a, num_gpu_blocks=16)
    first.add_request("first", prompt(1))  # 6 full blocks
    first.run()
    wait_for(lambda: cluster_stats(node_a).demotions >= 6, "node a publishes the prefix")

    second = make_engine(node_b, num_gpu_blocks=16)
    second.add_request("again", prompt(1) + [7])
    second.run()
    assert second.loaded_tokens("again") == 6 * BLOCK_TOKENS
    # vLLM counts them as hits from a peer (prompt_tokens_cached_by_source{source="p2p"})
    assert second.hits_by_source.get(CacheHitSource.P2P) == 6 * BLOCK_TOKENS, \
        second.hits_by_source
    assert cluster_stats(node_b).promotions >= 6  # they came up from the pool on node b
