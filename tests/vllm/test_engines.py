"""Several engines on one coordinator, each in its own process; engines killed; the
coordinator restarted under a running engine."""

from __future__ import annotations

from vllm_env import require_vllm

require_vllm()

import json  # noqa: E402
import signal  # noqa: E402

from control_support import drained_stats, wait_for  # noqa: E402
from engine_proc import engine_process, prompt, run_engine  # noqa: E402
from tiercache.link.client import Client  # noqa: E402
from tiercache.service.process import CoordinatorProcess  # noqa: E402
from vllm_harness import BLOCK_TOKENS  # noqa: E402

def stats(coordinator):
    with Client(coordinator.config) as client:
        return client.stats()


def test_two_engines_share_blocks_and_another_namespace_shares_nothing(coordinator, model_dir):
    first = run_engine(coordinator, model_dir, seed=7)
    assert first["loaded_tokens"] == 0
    second = run_engine(coordinator, model_dir, seed=7)
    assert second["loaded_tokens"] == 6 * BLOCK_TOKENS  # byte-checked in that process
    assert second["namespace"] == first["namespace"]
    other = run_engine(coordinator, model_dir, seed=7, salt="other-weights")
    assert other["loaded_tokens"] == 0 and other["namespace"] != first["namespace"]


def test_an_engine_killed_mid_request_leaves_no_leases_or_reservations(coordinator, model_dir):
    run_engine(coordinator, model_dir, seed=8)  # stores the prefix
    proc = engine_process(coordinator, model_dir, "hold", 8)
    try:
        held = json.loads(proc.stdout.readline())
        assert held == {"holding": True, "leased": 6, "reserved": 1}
        during = stats(coordinator)
        assert during.loading_blocks == 6 and during.writing_blocks == 1
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    after = wait_for(lambda: drained_stats(coordinator.config),
                     "the SIGKILLed engine's pins and reservations released", 60)
    assert after.ready_blocks == 6, "what was stored stays"


def test_the_coordinator_restarting_under_a_running_engine(coordinator, make_engine, tmp_path):
    engine = make_engine(coordinator, num_gpu_blocks=16)
    engine.add_request("before", prompt(9))
    engine.run()
    coordinator.kill()  # SIGKILL: the region stays, the socket goes

    engine.add_request("during", prompt(10))  # lookups miss, stores are skipped
    engine.run()
    assert engine.finished >= {"before", "during"}
    assert engine.manager.get_stats().metric_sections()[1][
        "vllm:kv_offload_tiercache_coordinator_up"] == {(): 0.0}

    again = CoordinatorProcess(coordinator.config, workdir=tmp_path / "restarted")
    try:
        wait_for(lambda: engine.manager.get_stats().metric_sections()[1][
            "vllm:kv_offload_tiercache_coordinator_up"] == {(): 1.0},
            "the engine reconnected to the restarted coordinator", 60)
        engine.add_request("filler", [200 + (i % 50) for i in range(230)])
        engine.run()
        engine.add_request("after", prompt(9) + [1])
        engine.run()
        # the index came back from the region: the prefix stored before the crash is loaded
        assert engine.loaded_tokens("after") == 6 * BLOCK_TOKENS
    finally:
        engine.shutdown()
        again.cleanup()


FILLER = [200 + (i % 50) for i in range(230)]  # takes every GPU block of a 16-block engine


def test_a_systemctl_restart_under_a_running_engine_keeps_its_cache(coordinator, make_engine,
                                                                   tmp_path):
    """SIGTERM, then `serve` again (what `systemctl restart` does) while the engine runs: the
    stop keeps the region its worker maps, the new coordinator re-adopts it, and the engine
    loads the prefix it stored before, exact (the harness checks every loaded block), and
    offloads new ones (was: a new, empty region under a worker mapping the old one)."""
    engine = make_engine(coordinator, num_gpu_blocks=16)
    engine.add_request("before", prompt(9))
    engine.run()
    assert coordinator.stop() == 0
    assert "kept region" in coordinator.output()
    again = CoordinatorProcess(coordinator.config, workdir=tmp_path / "restarted")
    try:
        assert "re-adopted stale region" in again.output()
        engine.add_request("filler", FILLER)
        engine.run()
        engine.add_request("after", prompt(9) + [1])
        engine.run()
        assert engine.loaded_tokens("after") == 6 * BLOCK_TOKENS
        engine.add_request("new", prompt(12))  # stored after the restart ...
        engine.run()
        engine.add_request("filler 2", [201 + (i % 50) for i in range(230)])
        engine.run()
        engine.add_request("new again", prompt(12) + [1])  # ... and loaded back
        engine.run()
        assert engine.loaded_tokens("new again") == 6 * BLOCK_TOKENS
    finally:
        engine.shutdown()
        again.cleanup()


def test_an_idle_engine_across_a_coordinator_restart_loads_on_its_next_request(
        coordinator, make_engine, tmp_path):
    """The coordinator is SIGKILLed and back while the engine is idle; the very next request
    gets its prefix from tiercache and its own chunks are offloaded (was: 0 external tokens
    and nothing offloaded, until the adapter noticed the restart a second later)."""
    engine = make_engine(coordinator, num_gpu_blocks=16)
    engine.add_request("before", prompt(9))
    engine.run()
    engine.add_request("filler", FILLER)  # the prefix is now only in tiercache
    engine.run()
    coordinator.kill()
    again = CoordinatorProcess(coordinator.config, workdir=tmp_path / "restarted")
    try:
        stored_before = stats(again).stored_blocks
        engine.add_request("after", prompt(9) + prompt(13, 40))
        engine.run()
        assert engine.loaded_tokens("after") == 6 * BLOCK_TOKENS
        wait_for(lambda: stats(again).stored_blocks > stored_before,
                 "the request's new chunks are offloaded", 30)
    finally:
        engine.shutdown()
        again.cleanup()
