"""Shared fixtures: unique instance names, and leak checks after every test.

Every test that creates IPC objects names them ``tiercache-test-<pid>-<uuid>`` (through
the ``make_config`` fixture); after each test nothing with this process's prefix may
remain in /dev/shm and no child process of this process may still run. Under xdist each
worker is its own process with its own pid, so a worker judges only what it made, never
what another worker has live. Tests marked ``serial`` (they change what other tests'
regions rely on: ``tiercache clean`` without a name) are skipped on xdist workers:
``make test`` runs them alone after the parallel run (scripts/run_tests.sh).
"""

from __future__ import annotations

import os
import uuid

import psutil
import pytest

from tiercache.config import Config, KVGeometry, RegionConfig, ExporterConfig

SHM_DIR = "/dev/shm"
# Names carry this pytest process's pid, so concurrent sessions never judge each other.
SESSION_TAG = f"test-{os.getpid()}-"
TEST_PREFIX = f"tiercache-{SESSION_TAG}"


def _test_entries() -> set[str]:
    return {n for n in os.listdir(SHM_DIR) if SESSION_TAG in n}  # regions, presence maps


def pytest_sessionstart(session):
    """Remove stale regions and key presence maps that earlier, killed pytest sessions left
    (never those of a session still running: its pid is in the name)."""
    from tiercache.region.stale import list_maps, list_regions, remove_stale, remove_stale_maps

    def of_a_dead_session(name: str) -> bool:
        parts = name.split("-")
        return (parts[0] == "test" and len(parts) > 1 and parts[1].isdigit()
                and not psutil.pid_exists(int(parts[1])))

    for listing in list_regions():
        if not listing.live and of_a_dead_session(listing.name):
            remove_stale(name_prefix=listing.name)
    remove_stale_maps(names=[m.name for m in list_maps() if of_a_dead_session(m.name)])


def pytest_collection_modifyitems(config, items):
    """On an xdist worker, skip what must not run beside other tests (``serial``)."""
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        return
    skip = pytest.mark.skip(reason="serial: never beside other tests; run alone with "
                                   "`pytest -m serial` (make test does, after the parallel run)")
    for item in items:
        if item.get_closest_marker("serial") is not None:
            item.add_marker(skip)


def _is_mp_helper(proc: psutil.Process) -> bool:
    """multiprocessing's resource tracker / forkserver live for the whole session."""
    try:
        cmdline = " ".join(proc.cmdline())
    except psutil.Error:
        return True  # already gone
    # (and a test module's vLLM event subscriber, which its module fixture closes)
    return ("resource_tracker" in cmdline or "forkserver" in cmdline
            or "vllm_subscriber.py" in cmdline)


@pytest.fixture(autouse=True)
def no_leaks():
    before = _test_entries()
    yield
    me = psutil.Process()
    children = [c for c in me.children(recursive=True) if not _is_mp_helper(c)]
    for child in children:
        child.kill()
    psutil.wait_procs(children, timeout=5)
    leaked = _test_entries() - before
    for name in leaked:
        os.unlink(os.path.join(SHM_DIR, name))
    assert not children, f"test left processes running: {[c.pid for c in children]}"
    assert not leaked, f"test left /dev/shm entries: {sorted(leaked)}"


@pytest.fixture(scope="module")
def subscriber():
    """A KV-event subscriber process decoding with vLLM 0.33's own classes (one per test
    module: importing vLLM takes seconds); see ``tests/support/event_support.py``."""
    from event_support import VllmSubscriber

    sub = VllmSubscriber()
    yield sub
    sub.close()


@pytest.fixture
def instance_name() -> str:
    return f"{SESSION_TAG}{uuid.uuid4().hex[:8]}"


@pytest.fixture
def make_config(instance_name, tmp_path):
    """Build a small, unique Config; keyword arguments override the defaults."""

    def make(**overrides) -> Config:
        kv = overrides.pop("kv", KVGeometry(page_bytes=(4096, 8192, 4096), block_size_factor=1))
        region = overrides.pop("region", RegionConfig(capacity_bytes=None, num_blocks=16,
                                                      prefault_threads=2))
        fields = dict(
            name=instance_name, world_size=2, kv=kv, region=region,
            exporter=ExporterConfig(port=0),
            control_socket=str(tmp_path / "control.sock"),
            # the suite's caches are a few blocks, and most scenarios let one client fill
            # one; the per-session cap has tests of its own (tests/index/test_liveness.py)
            index_max_session_share=1.0,
        )
        fields.update(overrides)
        return Config(**fields)

    return make
