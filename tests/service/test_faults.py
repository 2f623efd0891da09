"""Faults an engine lives through: a worker SIGKILLed mid-transfer, the coordinator
SIGKILLed under load, SIGTERM. Real processes throughout; no loaded block may ever be wrong."""

from __future__ import annotations

import json
from contextlib import contextmanager
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tiercache.config import config_to_toml
from tiercache.tools.demo.workload import PrefixWorkload
from tiercache.errors import CoordinatorGoneError, JobError
from tiercache.service.process import CoordinatorProcess

from e2e_support import (
    DOWN_WITHIN_S, SPEC, WAIT_S, assert_metrics_match_workers, await_sample, cached_request,
    e2e_config, metrics_url, running_engine, sample, scrape,
)


def test_sigkilled_worker_is_down_within_5s_fails_its_jobs_and_rejoins(make_config, tmp_path):
    config = e2e_config(make_config, 2)
    with CoordinatorProcess(config, tmp_path) as coordinator, running_engine(config) as engine:
        url = metrics_url(coordinator)
        workload = PrefixWorkload(SPEC)
        warm = [engine.run(r) for r in workload.requests(20)]
        request = cached_request(engine, warm, b"after-the-kill")
        engine.stall([1])  # rank 1's transfers queue behind its compute stream
        submission = engine.submit(request)
        jobs = (submission.load_job, submission.store_job)
        assert None not in jobs
        engine.wait_for(lambda: all(engine.tracker.pending_ranks(j) == {1} for j in jobs),
                        WAIT_S, "rank 0 reports both jobs while rank 1 holds them")
        survivor, victim = engine.worker_pids()
        os.kill(victim, signal.SIGKILL)
        assert await_sample(url, "tiercache_worker_up", 0, DOWN_WITHIN_S, rank="1") <= DOWN_WITHIN_S
        assert sample(scrape(url), "tiercache_worker_up", rank="0") == 1

        engine.wait_idle(WAIT_S)  # the dead rank's jobs fail; nothing hangs
        for job in jobs:
            outcome = engine.outcomes[job]
            assert (outcome.success, outcome.lost_ranks, outcome.failed_ranks) == (False, (1,), ())
        index = engine.client.stats()
        assert (index.writing_blocks, index.loading_blocks) == (0, 0)  # both completed
        assert engine.client.lookup(submission.stored_keys) == 0  # the failed store was freed
        rank0 = engine.totals.ranks[0]
        assert all(d.transfers_failed == 0 for d in rank0)  # rank 0 finished its parts
        with pytest.raises(JobError, match=r"rank\(s\) \[1\] are down"):
            engine.submit(request)

        engine.restart_rank(1)
        await_sample(url, "tiercache_worker_up", 1, WAIT_S, rank="1")
        samples = scrape(url)
        assert sample(samples, "tiercache_worker_attaches_total", rank="1") == 2
        assert sample(samples, "tiercache_worker_attaches_total", rank="0") == 1
        assert engine.worker_pids()[0] == survivor
        again = engine.run(request)  # the workload resumes where it was
        assert again.hit_blocks == request.num_context_blocks and again.store_job is not None
        for r in workload.requests(15):
            engine.run(r)
        t = engine.totals
        assert t.mismatched_blocks == 0 and t.checked_blocks > 0
        assert (t.failed_jobs, t.rank_restarts) == (2, 1)
        assert_metrics_match_workers(scrape(url), engine)  # the stalled copies never ran
        assert engine.stats_agree()


def test_sigkilled_coordinator_transfers_finish_clients_see_it_gone_and_reconnect(make_config,
                                                                                tmp_path):
    config = e2e_config(make_config, 2)
    first = CoordinatorProcess(config, tmp_path / "first")
    try:
        with running_engine(config) as engine:
            workload = PrefixWorkload(SPEC)
            warm = [engine.run(r) for r in workload.requests(20)]
            request = cached_request(engine, warm, b"while-it-dies")
            pids = engine.worker_pids()
            engine.stall([0, 1])
            submission = engine.submit(request)
            first.kill()
            engine.release([0, 1])
            engine.wait_idle(WAIT_S)  # the workers finish the in-flight transfers ...
            t = engine.totals
            assert all(d.transfers_failed == 0 for dirs in t.ranks for d in dirs)
            assert t.checked_blocks >= 2 * submission.hit_blocks and t.mismatched_blocks == 0
            assert (t.orphaned_jobs, t.failed_jobs) == (2, 0)  # ... never completed elsewhere
            hits_before = t.hit_blocks
            with pytest.raises(CoordinatorGoneError):
                engine.client.lookup(request.keys)
            with pytest.raises(CoordinatorGoneError):
                engine.run(next(workload.requests(1)))

            with CoordinatorProcess(config, tmp_path / "second") as second:
                out = second.output()
                assert "re-adopted stale region" in out and "generation 2" in out, out
                url = metrics_url(second)
                for r in workload.requests(25):  # the client reconnects by itself
                    engine.run(r)
                assert t.hit_blocks > hits_before  # a fresh index that fills again
                assert t.mismatched_blocks == 0
                assert engine.worker_pids() == pids  # no worker had to re-attach
                samples = scrape(url)
                for rank in range(2):
                    assert sample(samples, "tiercache_worker_up", rank=str(rank)) == 1
                    assert sample(samples, "tiercache_worker_attaches_total", rank=str(rank)) == 1
                assert sample(samples, "tiercache_region_generation") == 2
                assert_metrics_match_workers(samples, engine)  # counters live in the region

                assert second.stop() == 0  # SIGTERM with workers still attached:
                assert os.path.exists(f"/dev/shm/{config.shm_name}")  # the region they map stays
                assert "kept region" in second.output()
                assert not os.path.exists(config.socket_path)
    finally:
        first.kill()


def _wait_for_line(path, text: str, proc: subprocess.Popen) -> str:
    """Until the demo writes ``text`` or exits (a loaded machine took more than 60 s): the
    test's own timeout is the backstop for a demo that hangs alive."""
    while True:
        content = path.read_text()
        if text in content:
            return content
        assert proc.poll() is None, f"demo exited with {proc.returncode}:\n{content}"
        time.sleep(0.05)


@contextmanager
def _demo(make_config, tmp_path):
    """A ``tiercache demo`` of 2 ranks running until stopped; yields (config, process, log
    path, JSON path) once its first progress line is out, and kills it if still running."""
    config = e2e_config(make_config, 2)
    config_path = tmp_path / "demo.toml"
    config_path.write_text(config_to_toml(config))
    log_path, json_path = tmp_path / "demo.log", tmp_path / "summary.json"
    with log_path.open("w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "tiercache", "demo", "--config", str(config_path),
             "--requests", "0", "--json", str(json_path)],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            _wait_for_line(log_path, "requests ", proc)  # the first progress line
            yield config, proc, log_path, json_path
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def _assert_left_nothing(config, doc) -> None:
    assert not os.path.exists(f"/dev/shm/{config.shm_name}")
    assert not os.path.exists(config.socket_path)
    for pid in doc["worker_pids"] + [doc["coordinator_pid"]]:
        assert not psutil.pid_exists(pid), f"pid {pid} outlived the demo"


def test_sigterm_stops_the_demo_cleanly_and_leaves_nothing(make_config, tmp_path):
    with _demo(make_config, tmp_path) as (config, proc, log_path, json_path):
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) == 0, log_path.read_text()
    output = log_path.read_text()
    assert "SIGTERM: finishing the current request, then stopping" in output
    doc = json.loads(json_path.read_text())
    assert doc["interrupted"] and doc["requests"] > 0
    assert doc["mismatched_blocks"] == 0 and doc["stats_agree"]
    _assert_left_nothing(config, doc)


def _wait_after(path, marker: str, text: str, proc: subprocess.Popen) -> str:
    """Until ``text`` appears in the output after the first ``marker``, or the demo exits."""
    while True:
        content = path.read_text()
        at = content.find(marker)
        if at >= 0 and text in content[at + len(marker):]:
            return content
        assert proc.poll() is None, f"demo exited with {proc.returncode}:\n{content}"
        time.sleep(0.05)


def test_the_demo_itself_restarts_a_killed_worker_and_its_killed_coordinator(make_config,
                                                                           tmp_path):
    import re

    with _demo(make_config, tmp_path) as (config, proc, log_path, json_path):
        out = log_path.read_text()
        worker = int(re.search(r"rank 1: worker pid (\d+)", out).group(1))
        coordinator = int(re.search(r"started a coordinator \(pid (\d+)\)", out).group(1))
        os.kill(worker, signal.SIGKILL)
        restarted = "rank 1's worker is gone; restarting it"
        _wait_after(log_path, restarted, "requests ", proc)  # and it goes on
        os.kill(coordinator, signal.SIGKILL)
        replaced = "the coordinator is gone; starting a new one"
        _wait_after(log_path, replaced, "requests ", proc)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) == 0, log_path.read_text()
    doc = json.loads(json_path.read_text())
    assert doc["rank_restarts"] == 1 and doc["coordinator_gone"] >= 1
    assert doc["mismatched_blocks"] == 0 and doc["checked_blocks"] > 0
    assert doc["coordinator_pid"] != coordinator and worker not in doc["worker_pids"]
    _assert_left_nothing(config, doc)
