"""``tiercache demo``: its workload, its content check (it must catch a wrong byte), its
wire format, and the command as a user runs it (spawning or joining a coordinator)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter

import numpy as np
import psutil
import pytest

from tiercache.config import config_to_toml
from tiercache.tools.demo.rank import RankOptions, RankSession
from tiercache.tools.demo.wire import Command, Op, Report
from tiercache.tools.demo.workload import PrefixWorkload, WorkloadSpec
from tiercache.tools.demo.content import key_seeds
from tiercache.errors import ConfigError, ProtocolError
from tiercache.region.shared import SharedOffloadRegion
from tiercache.specs import Direction
from tiercache.service.process import CoordinatorProcess

from e2e_support import e2e_config, metrics_url, sample, scrape

WAIT_S = 60.0


# ------------------------------------------------------------------ workload
def test_workload_is_deterministic_zipf_skewed_and_turns_extend_earlier_requests():
    spec = WorkloadSpec(num_prefixes=6, zipf_s=1.2, continue_p=0.5, max_request_blocks=40,
                        seed=5)
    requests = list(PrefixWorkload(spec).requests(400))
    assert [r.keys for r in requests] == [r.keys for r in PrefixWorkload(spec).requests(400)]
    assert [r.keys for r in requests] != [r.keys for r in PrefixWorkload(
        WorkloadSpec(num_prefixes=6, zipf_s=1.2, continue_p=0.5, max_request_blocks=40,
                     seed=6)).requests(400)]
    starts = Counter(r.prefix for r in requests)
    assert starts.most_common(1)[0][0] == 0 and starts[0] > starts[5]
    seen: dict[bytes, int] = {}
    turns = 0
    for r in requests:
        assert 1 <= len(r.keys) <= spec.max_request_blocks
        assert len(set(r.keys)) == len(r.keys)
        context, suffix = r.keys[:r.num_context_blocks], r.keys[r.num_context_blocks:]
        assert suffix and not any(k in seen for k in suffix)  # suffix blocks are new
        if any(k in seen and seen[k] >= spec.num_prefixes for k in context):
            turns += 1  # this context contains an earlier request's suffix
        for k in suffix:
            seen[k] = spec.num_prefixes + r.index
        for k in context:
            seen.setdefault(k, r.prefix)
    assert turns > 100


def test_workload_spec_refusals_name_the_value():
    with pytest.raises(ConfigError, match="max_request_blocks = 5"):
        WorkloadSpec(max_prefix_blocks=4, max_suffix_blocks=2, max_request_blocks=5)
    with pytest.raises(ConfigError, match="continue_p = 1.5"):
        WorkloadSpec(continue_p=1.5)
    with pytest.raises(ConfigError, match="prefix blocks 5..2"):
        WorkloadSpec(min_prefix_blocks=5, max_prefix_blocks=2)


# ------------------------------------------------------------------ wire
def test_wire_records_round_trip_and_a_short_command_is_refused():
    command = Command(Op.LOAD, 42, np.array([3, 1]), np.array([0, 1, 2, 3]),
                      np.array([7, 2**64 - 1], dtype=np.uint64))
    back = Command.unpack(command.pack(), block_size_factor=2)
    assert (back.op, back.job_id) == (Op.LOAD, 42)
    assert back.cpu_ids.tolist() == [3, 1] and back.gpu_ids.tolist() == [0, 1, 2, 3]
    assert back.seeds.tolist() == [7, 2**64 - 1]
    with pytest.raises(ProtocolError, match="needs"):
        Command.unpack(command.pack()[:-8], block_size_factor=2)
    report = Report(Op.DONE, 3, 99, 2, 42, Direction.CPU_TO_GPU, False, 4096, 0.5, 2, 1)
    assert Report.unpack(report.pack()) == report


# ------------------------------------------------------------------ content check
def test_a_rank_catches_a_wrong_byte_in_a_loaded_block(make_config):
    config = make_config()
    keys = [b"%016d" % i for i in range(4)]
    seeds = key_seeds(keys)
    with SharedOffloadRegion.create(config) as region:
        session = RankSession(config, 1, RankOptions("cpu", num_gpu_blocks=8))
        try:
            cpu_ids = np.array([5, 9, 2, 7])
            session.handle(Command(Op.STORE, 1, cpu_ids, np.arange(4), seeds))
            session.worker.wait([1])
            (stored,) = [session.report(r) for r in session.worker.get_finished()]
            assert stored.success and stored.num_blocks == 4
            row = region.rank_array(1)[9]  # the second key's row in rank 1's slice
            row[region.layout.page_offsets[2] + 100] ^= 0xFF  # one byte of tensor 2
            session.handle(Command(Op.LOAD, 2, cpu_ids, np.array([4, 5, 6, 7]), seeds))
            session.worker.wait([2])
            (loaded,) = [session.report(r) for r in session.worker.get_finished()]
            assert (loaded.success, loaded.num_blocks, loaded.mismatched_blocks) == (True, 4, 1)
            other_rank = Command(Op.LOAD, 3, cpu_ids[:1], np.array([0]), seeds[:1])
            session.handle(other_rank)  # rank 1's bytes hold rank 1's content only
            session.worker.wait([3])
            (own,) = [session.report(r) for r in session.worker.get_finished()]
            assert own.mismatched_blocks == 0
        finally:
            session.close()


# ------------------------------------------------------------------ the command
def demo(*args: str, timeout_s: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tiercache", "demo", *args],
                          capture_output=True, text=True, timeout=timeout_s)


def test_demo_spawns_a_coordinator_replays_benches_and_removes_everything(make_config, tmp_path):
    config = e2e_config(make_config, 2)
    path = tmp_path / "demo.toml"
    path.write_text(config_to_toml(config))
    result = demo("--config", str(path), "--requests", "40", "--bench", "--bench-blocks", "16",
                  "--bench-reps", "2", "--json", "-", "--quiet")
    assert result.returncode == 0, result.stderr
    assert "started a coordinator" in result.stderr
    assert "rank 1: worker pid" in result.stderr
    doc = json.loads(result.stdout)
    assert (doc["requests"], doc["world_size"], doc["device"], doc["coordinator"]) == \
        (40, 2, "cpu", "spawned")
    assert doc["mismatched_blocks"] == 0 and doc["checked_blocks"] > 2 * 16
    assert doc["hit_blocks"] > 0 and doc["stats_agree"]
    assert doc["backends"] == [["cpu", "cpu"], ["cpu", "cpu"]]
    for label in ("gpu_to_cpu", "cpu_to_gpu"):
        bench = doc["bench"]["directions"][label]
        assert bench["all"]["ranks"] == 2 and bench["solo"]["ranks"] == 1
        assert bench["all"]["bytes"] == 2 * 2 * 16 * config.kv.cpu_block_bytes
        assert bench["scaling"] > 0
    assert not os.path.exists(f"/dev/shm/{config.shm_name}")
    assert not os.path.exists(config.socket_path)
    for pid in doc["worker_pids"] + [doc["coordinator_pid"]]:
        assert not psutil.pid_exists(pid)


def test_demo_joins_a_live_coordinator_and_leaves_it_serving(make_config, tmp_path):
    config = e2e_config(make_config, 2)
    with CoordinatorProcess(config, tmp_path) as coordinator:
        result = demo("--config", str(coordinator.config_path), "--requests", "30",
                      "--json", str(tmp_path / "out.json"))
        assert result.returncode == 0, result.stderr
        assert f"joined the live coordinator of {config.name!r} (pid {coordinator.pid})" \
            in result.stderr
        assert "30 requests on 2 rank(s) (cpu)" in result.stdout
        assert "0 wrong" in result.stdout
        doc = json.loads((tmp_path / "out.json").read_text())
        assert doc["coordinator"] == "joined" and doc["mismatched_blocks"] == 0
        samples = scrape(metrics_url(coordinator))  # still serving, counters agree
        for entry in doc["per_rank"]:
            for label in ("gpu_to_cpu", "cpu_to_gpu"):
                assert sample(samples, "tiercache_transfer_bytes_total", rank=str(entry["rank"]),
                              direction=label) == entry[label]["bytes"]
        assert sample(samples, "tiercache_index_lookups_total") == 30
        assert coordinator.proc.poll() is None

        refused = demo("--config", str(coordinator.config_path), "--ranks", "3")
        assert refused.returncode == 1
        assert "a live coordinator serves" in refused.stderr
        assert "[2 rank(s) x 96 blocks" in refused.stderr and "needs [3 rank(s)" in refused.stderr


def test_demo_refuses_more_cuda_ranks_than_gpus(tmp_path, make_config):
    path = tmp_path / "demo.toml"
    path.write_text(config_to_toml(make_config()))
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    result = demo("--config", str(path), "--device", "cuda", "--ranks", str(gpus + 1))
    assert result.returncode == 1
    assert f"--ranks {gpus + 1} with --device cuda: one GPU per rank, and this host has " \
           f"{gpus}" in result.stderr
