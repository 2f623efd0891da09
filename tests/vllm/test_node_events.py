"""The node's event stream with real vLLM 0.33 engines (its Scheduler and
OffloadingConnector, ``TierCacheOffloadingSpec``) against a real ``tiercache serve``, read by
a subscriber that decodes with vLLM's own ``KVEventBatch``: an engine's offloaded prefix is
``BlockStored`` ("CPU") with exactly the hashes vLLM computed for it, another engine's
pressure removes it, a demotion is "STORAGE", a restart leaves no stale block, a late
subscriber replays, two namespaces are told apart, and chunked offload publishes what
vLLM's own connector publishes for its CPU tier."""

from __future__ import annotations

from vllm_env import require_vllm

require_vllm()

import dataclasses  # noqa: E402

import pytest  # noqa: E402

from control_support import wait_for  # noqa: E402
from engine_proc import prompt, run_engine  # noqa: E402
from event_support import free_port, stream_endpoints  # noqa: E402
from tiercache.config import DiskConfig, EventsConfig  # noqa: E402
from tiercache.link.client import Client  # noqa: E402
from tiercache.service.process import CoordinatorProcess  # noqa: E402



@pytest.fixture
def serve(tiny_model, instance_name, tmp_path):
    """``serve(num_chunks, events=True, port=0, **kw)`` -> a running coordinator."""
    started = []

    def start(num_chunks=8, events=True, port=0, workdir="coord", **kw):
        config = tiny_model.coordinator_config(instance_name, str(tmp_path / "c.sock"),
                                               num_chunks, **kw)
        if events:
            replay = free_port() if port else 0
            config = dataclasses.replace(config, events=EventsConfig(
                endpoint=f"tcp://127.0.0.1:{port}", replay_endpoint=f"tcp://127.0.0.1:{replay}",
                batch_interval_s=0.02))
        process = CoordinatorProcess(config, workdir=tmp_path / workdir)
        started.append(process)
        return process

    yield start
    for process in reversed(started):
        process.cleanup()


def _run(engine, req_id, tokens):
    engine.add_request(req_id, tokens)
    engine.run()


def _gpu_hashes(engine, tokens_per_block=16):
    """The hashes vLLM's own KV events gave this engine's GPU blocks, in store order."""
    return [h for e in engine.kv_events.events if type(e).__name__ == "BlockStored"
            and e.medium in (None, "GPU") for h in e.block_hashes]


def _cpu_events(engine):
    return [e for e in engine.kv_events.events if getattr(e, "medium", None) == "CPU"]


def _topic(engine):
    ns = engine.manager.namespace
    return f"{ns.model}@{ns.digest.hex()}"


def test_an_engines_prefix_with_vllms_hashes_another_engines_pressure_and_two_namespaces(
        serve, make_engine, model_dir, subscriber):
    coordinator = serve(num_chunks=8)
    seen = subscriber.connect(*stream_endpoints(coordinator))
    a = make_engine(coordinator, num_gpu_blocks=16, kv_events=True)
    _run(a, "a", prompt(1))  # 6 full blocks, offloaded as 6 chunks
    mine = set(_gpu_hashes(a))
    assert len(mine) == 6
    topic = _topic(a)
    subscriber.until(lambda s: s.held() == {(topic, "CPU"): mine})
    assert _cpu_events(a) == []  # the engine leaves its CPU tier's events to the node
    b = run_engine(coordinator, model_dir, seed=2)  # 6 more chunks in 8 slots
    assert b["namespace"] == coordinator_namespace(a)
    subscriber.until(lambda s: len(s.held()[(topic, "CPU")]) == 8)
    removed = {h for _, e in seen.events("BlockRemoved") for h in e["block_hashes"]}
    assert len(removed) == 4 and removed <= mine  # another engine's pressure evicted A's
    assert seen.held()[(topic, "CPU")] >= mine - removed
    other = run_engine(coordinator, model_dir, seed=1, salt="other-weights")
    other_topic = f"{a.manager.namespace.model}@{other['namespace']}"
    # 6 stored, and the 6 of A's namespace they evicted: one round of the publisher, but
    # a batch per topic, so wait for both before a late subscriber compares
    subscriber.until(lambda s: len(s.held().get((other_topic, "CPU"), ())) == 6
                     and len(s.held()[(topic, "CPU")]) == 2)
    assert seen.held()[(other_topic, "CPU")] == mine  # same tokens, same hashes: the topic
    assert not seen.gaps and seen.seqs == list(range(len(seen.seqs)))
    assert not seen.errors
    late = subscriber.connect(*stream_endpoints(coordinator))  # a late subscriber replays
    subscriber.until(lambda s: s.held() == seen.held())
    assert all(batch["replayed"] for batch in late.batches[:len(seen.batches) - 1])


def coordinator_namespace(engine):
    return engine.manager.namespace.digest.hex()


def test_chunked_offload_publishes_what_vllms_own_connector_publishes(
        serve, make_engine, subscriber):
    """blocks_per_chunk = 2: vLLM's own CPU-tier events (the adapter's, with no node stream)
    and the node stream name the same chunks by the same hashes, fields and groups."""
    own = serve(num_chunks=8, events=False, blocks_per_chunk=2, workdir="own")
    engine = make_engine(own, num_gpu_blocks=16, kv_events=True, blocks_per_chunk=2)
    _run(engine, "r", prompt(3))
    vllm_own = [dataclasses.asdict(e) if dataclasses.is_dataclass(e) else
                {f: getattr(e, f) for f in e.__struct_fields__} for e in _cpu_events(engine)]
    assert len(vllm_own) == 3  # 6 blocks, 3 chunks, one event each
    blocks = list(_wire_keys(engine, prompt(3)))  # vLLM's hashes of the 6 blocks, in order
    assert set(_gpu_hashes(engine)) == set(blocks)
    # each chunk is named by its last block's hash
    assert sorted(e["block_hashes"] for e in vllm_own) == sorted([blocks[i]] for i in (1, 3, 5))
    engine.shutdown()
    own.cleanup()

    node = serve(num_chunks=8, blocks_per_chunk=2, workdir="node")
    seen = subscriber.connect(*stream_endpoints(node))
    # (vLLM's own publisher of the first engine still holds its port in this process)
    engine = make_engine(node, num_gpu_blocks=16, blocks_per_chunk=2)
    _run(engine, "r", prompt(3))
    subscriber.until(lambda s: len(s.events("BlockStored")) == 3)
    published = [{k: v for k, v in e.items() if k != "type"} for _, e in seen.events("BlockStored")]
    expected = [{k: v for k, v in e.items() if v is not None or k in (
        "parent_block_hash", "lora_id", "lora_name")} for e in vllm_own]
    key = lambda e: e["block_hashes"]  # noqa: E731
    assert sorted(published, key=key) == sorted(expected, key=key)


def test_demotion_is_storage_and_a_restart_leaves_no_stale_block(
        serve, make_engine, subscriber, tmp_path):
    (tmp_path / "disk").mkdir()
    disk = DiskConfig(path=str(tmp_path / "disk"), capacity_bytes=64 << 20, low_watermark=0.5)
    first = serve(num_chunks=8, port=free_port(), disk=disk, workdir="first")
    seen = subscriber.connect(*stream_endpoints(first))
    engine = make_engine(first, num_gpu_blocks=16, kv_events=True)
    _run(engine, "a", prompt(1))
    mine = set(_gpu_hashes(engine))
    topic = _topic(engine)
    subscriber.until(lambda s: s.held().get((topic, "STORAGE")) == mine)  # demoted ahead
    _run(engine, "b", prompt(2))
    _run(engine, "c", prompt(4))  # host memory turns over: some of A's leave it
    with Client(first.config) as client:
        wait_for(lambda: client.tier_stats()["disk"].demotions >= 12, "demotions")
    believed = seen.held()[(topic, "CPU")]
    first.kill()  # SIGKILL; the engine's worker still maps the region: the next one re-adopts
    second = serve(num_chunks=8, port=int(first.config.events.endpoint.rsplit(":", 1)[1]),
                   disk=disk, workdir="second")
    assert "re-adopted" in second.output()
    seen = subscriber.connect(*stream_endpoints(second))
    _run(engine, "d", prompt(5))  # the engine reconnects (and describes again) by itself
    keys = {}
    for seed in (1, 2, 4, 5):
        keys.update(_wire_keys(engine, prompt(seed)))
    with Client(second.config) as client:
        def exact(s) -> bool:
            """Believes exactly what host memory holds: as many blocks, each a hit (a hit
            promotes nothing, so asking changes nothing)."""
            believed = s.held().get((topic, "CPU"), set())
            return (len(believed) == client.stats().ready_blocks
                    and all(client.lookup([keys[h]]) == 1 for h in believed))

        subscriber.until(exact)  # a stale "stored" block would never leave the view
    first_batch = seen.batches[0]
    assert first_batch["seq"] == 0 and first_batch["events"] == [{"type": "AllBlocksCleared"}]
    assert believed and (topic, "STORAGE") in seen.held()  # the disk tier re-announced
    assert not seen.gaps


def _wire_keys(engine, tokens):
    """vLLM's int hash -> the wire key of each full block of ``tokens`` (vLLM's own block
    hasher, the engine's namespace digest, KV group 0)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher
    from vllm.v1.request import Request

    request = Request(request_id="hashes", prompt_token_ids=list(tokens),
                      sampling_params=SamplingParams(max_tokens=1), pooling_params=None,
                      block_hasher=get_request_block_hasher(16, sha256))
    digest = engine.manager.namespace.digest
    return {int.from_bytes(h[-8:], "big"): digest + h + (0).to_bytes(4, "big")
            for h in request.block_hashes}
