"""`tiercache replay`'s tiercache arm beside the node: the prefix router reading the real
coordinator's node event stream (a ZMQ SUB on `tiercache serve`'s `[events]`), and the
disk tier under the host tier.

No timed assertions: hits are vLLM's own prefill stats, routes follow from them."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from vllm_env import require_vllm

require_vllm()

from e2e_support import metrics_url, scrape  # noqa: E402
from event_support import WAIT_S, namespace, vllm_int_hash, vllm_key  # noqa: E402

from tiercache.config import EventsConfig  # noqa: E402
from tiercache.link.client import Client  # noqa: E402
from tiercache.link.namespaces import EngineFamily  # noqa: E402
from tiercache.service.process import CoordinatorProcess  # noqa: E402
from tiercache.tools.replay.cli import replay  # noqa: E402
from tiercache.tools.replay.cost import TIERCACHE_DISK_READ_BPS  # noqa: E402
from tiercache.tools.replay.events import CPU  # noqa: E402
from tiercache.tools.replay.nodestream import NodeStreamView, bound_endpoints  # noqa: E402
from tiercache.tools.replay.routers import RouterKind  # noqa: E402
from tiercache.tools.replay.systems import System  # noqa: E402
from tiercache.tools.replay.trace import Trace, TraceRequest  # noqa: E402

LLAMA = Path(__file__).parents[1] / "fixtures" / "models" / "Llama-3.1-8B-Instruct"
GPU_TOKENS = 8192  # the least the replay allows: 512 blocks of 16 tokens
BLOCK_BYTES = 2 * 1024 * 1024  # Llama-3.1-8B: 32 layers x 64 KiB per 16-token block


def prompt(seed: int, n: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(1000, 30000) for _ in range(n))


def hits(report: dict, system: System) -> dict[str, int]:
    return report["systems"][system.value]["hit_tokens"]


def test_the_prefix_router_sends_a_node_held_prefix_to_the_idle_engine():
    """P (6 full blocks) runs on engine 0 and is stored in the node cache. F1, F2, F3 (P
    and 4 blocks of their own: 60 % of each is P) arrive together. Engine 0 holds P on
    its GPU (prefix 3 x 0.6 = 1.8); each F it takes costs it 2 / 8 of load. Without the
    node's view engine 1 scores nothing for P and every F goes to engine 0 (as in
    ``none``: GPU hits of 3 x 96 tokens). With it, engine 1 scores 0.8 x 1.8 = 1.44 for
    P from host memory: F3 (engine 0 two requests busier: 1.8 + 1.5 < 1.44 + 2) goes to
    engine 1, a host hit. So the tiercache arm's F3 lands where the node's stream says,
    or the test fails."""
    p = prompt(0, 96)
    requests = [TraceRequest(0.0, "p", p, 2)]
    requests += [TraceRequest(1.0, f"f{i}", p + prompt(10 + i, 64), 2) for i in range(3)]
    report = replay(Trace(tuple(requests)), LLAMA, [System.NONE, System.TIERCACHE],
                    RouterKind.PREFIX, engines=2, dram_bytes=2048 * BLOCK_BYTES,
                    gpu_kv_tokens=GPU_TOKENS)
    assert hits(report, System.NONE) == {"gpu": 3 * 96, "host": 0, "disk": 0}
    assert hits(report, System.TIERCACHE) == {"gpu": 2 * 96, "host": 96, "disk": 0}
    stream = report["systems"]["tiercache"]["node_stream"]
    assert stream["events"] >= 6 and stream["batches"] >= 1
    assert report["systems"]["tiercache"]["loaded_blocks_checked"] == 6


def lost_prefix_trace() -> Trace:
    """P (6 blocks), then 30 fillers of 40 blocks (1200 in all), then P again: through a
    host tier of 512 blocks P leaves the GPU (512 blocks) and host memory."""
    p = prompt(0, 100)
    requests = [TraceRequest(0.0, "p", p, 2)]
    requests += [TraceRequest(1.0 + i / 2, f"f{i}", prompt(100 + i, 640), 2) for i in range(30)]
    requests += [TraceRequest(20.0, "p", p, 2)]
    return Trace(tuple(requests))


def replay_with_disk(trace: Trace, systems: list[System], **kw) -> dict:
    return replay(trace, LLAMA, systems, RouterKind.ROUND_ROBIN, engines=1,
                  dram_bytes=512 * BLOCK_BYTES, disk_bytes=4096 * BLOCK_BYTES,
                  gpu_kv_tokens=GPU_TOKENS, **kw)


def test_a_prefix_the_host_tier_lost_is_a_disk_hit_and_the_identity_holds():
    """``lost_prefix_trace`` with a disk tier of 4096 blocks: the chain demoted P ahead of
    eviction, so the second P loads it from disk (hit source DISK); the identity holds
    with disk hits. vLLM's own offloading, the same 512 blocks of DRAM and no disk, has
    lost it."""
    trace = lost_prefix_trace()
    report = replay_with_disk(trace, [System.VLLM_NATIVE, System.TIERCACHE])
    assert hits(report, System.VLLM_NATIVE) == {"gpu": 0, "host": 0, "disk": 0}
    tc = report["systems"]["tiercache"]
    assert tc["hit_tokens"] == {"gpu": 0, "host": 0, "disk": 96}
    assert tc["computed_prefill_tokens"] + sum(tc["hit_tokens"].values()) == \
        tc["prompt_tokens"] == trace.prompt_tokens
    assert tc["loaded_blocks_checked"] == 6  # P's blocks, promoted from disk, then loaded
    assert tc["disk_tier"]["demotions"] >= 6 and tc["disk_tier"]["promotions"] >= 6
    assert tc["disk_read_blocks"] == 6  # read on the clock before their load


def test_a_disk_hit_waits_for_its_read_on_the_clock():
    """The same trace twice in the tiercache arm: at the cost model's measured disk read
    rate, and at a rate so high that the read takes nothing. Only the second P reads from
    disk (6 blocks of the model's true 2 MiB), and its TTFT grows by their bytes / the
    rate, to within the step the engine notices the load's end in (an idle step while it
    waits; one more for a probe answered a step late in either run). The requests that
    read nothing from disk keep the same TTFT but for such a step."""
    trace = lost_prefix_trace()
    slow = replay_with_disk(trace, [System.TIERCACHE], per_request=True)
    fast = replay_with_disk(trace, [System.TIERCACHE], per_request=True, disk_read_bps=1e18)
    cost = slow["cost_model"]["tiercache"]
    assert cost["disk_read_bps"] == TIERCACHE_DISK_READ_BPS
    assert fast["cost_model"]["tiercache"]["disk_read_bps"] == 1e18
    for report in (slow, fast):
        tc = report["systems"]["tiercache"]
        assert tc["hit_tokens"] == {"gpu": 0, "host": 0, "disk": 96}
        assert tc["computed_prefill_tokens"] + sum(tc["hit_tokens"].values()) == \
            tc["prompt_tokens"] == trace.prompt_tokens
        assert tc["disk_read_blocks"] == 6
        readers = [r for r in tc["per_request"] if r["disk_read_blocks"]]
        assert [r["req_id"] for r in readers] == [f"r{len(trace.requests) - 1}"]
        assert readers[0]["disk_read_blocks"] == 6
    expected_s = 6 * cost["block_bytes"] / cost["disk_read_bps"]
    assert cost["block_bytes"] == BLOCK_BYTES
    assert slow["systems"]["tiercache"]["disk_read_s"] == pytest.approx(expected_s, abs=1e-6)
    step_s = cost["idle_step_s"]
    ttft = {name: {r["req_id"]: r["ttft_s"] for r in report["systems"]["tiercache"]["per_request"]}
            for name, report in (("slow", slow), ("fast", fast))}
    last = f"r{len(trace.requests) - 1}"
    grew = ttft["slow"][last] - ttft["fast"][last]
    assert expected_s - 2 * step_s <= grew <= expected_s + 2 * step_s, (grew, expected_s)
    for req_id, fast_s in ttft["fast"].items():
        if req_id != last:
            assert abs(ttft["slow"][req_id] - fast_s) <= 2 * step_s, req_id


def _store(client, keys):
    out = client.prepare_store(keys)
    assert out is not None
    client.complete_store(list(out.keys_to_store))


def _await_stored_events(url: str, n: int) -> None:
    """Until the stream has published ``n`` BlockStored events (the series appears with
    the first)."""
    key = ("tiercache_events_published_total", (("medium", "CPU"), ("type", "BlockStored")))
    deadline = time.monotonic() + WAIT_S
    while scrape(url).get(key, 0) != n:
        assert time.monotonic() < deadline, f"{n} BlockStored events not published in {WAIT_S} s"
        time.sleep(0.05)


def test_the_node_view_joins_late_and_is_the_index_after_each_sync(make_config, tmp_path):
    """An engine (a real client of a real serve) stores 6 blocks and the stream publishes
    them before the view subscribes: only vLLM's replay protocol can bring them, and sync
    waits for it. Then 14 more blocks into 16 slots evict 4 of the first: after sync the
    view holds exactly what the index holds, block for block."""
    config = make_config(world_size=1, index_events=True, events=EventsConfig(
        endpoint="tcp://127.0.0.1:0", replay_endpoint="tcp://127.0.0.1:0",
        batch_interval_s=0.02))
    ns = namespace()
    first = [vllm_key(ns, i.to_bytes(32, "big")) for i in range(6)]
    more = [vllm_key(ns, i.to_bytes(32, "big")) for i in range(100, 114)]
    with CoordinatorProcess(config, tmp_path) as coordinator, Client(config) as engine:
        engine.describe(EngineFamily.VLLM, ns.description)
        _store(engine, first)
        # AllBlocksCleared, then the 6 stores: published before anyone listens
        _await_stored_events(metrics_url(coordinator), 6)
        view = NodeStreamView(config, *bound_endpoints(coordinator.output()))
        try:
            view.sync()
            assert {vllm_int_hash(k[8:-4]) for k in first} == view.held[CPU]
            assert view.num_replays >= 1
            _store(engine, more)
            view.sync()
            held = {vllm_int_hash(k[8:-4]) for k in first + more if engine.lookup([k]) == 1}
            assert len(held) == 16 and view.held[CPU] == held
        finally:
            view.close()
