"""``tiercache serve`` refuses a cheap precondition before it allocates anything: a real
``serve`` per case, /dev/shm watched while it runs (inotify), so "no region" means the
region never existed, not that it was made and removed again. Each refusal is one line on
stderr naming the value, exit status 1, and nothing left behind."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from shm_watch import ShmWatch
from tiercache.config import (
    ClusterConfig, DiskConfig, EventsConfig, ExporterConfig, KVGeometry, RegionConfig,
    config_to_toml,
)
from tiercache.errors import ConfigError

TIMEOUT_S = 60
ROW = 4096
SMALL_DISK_BYTES = 16 << 20


def refused_start(cfg, tmp_path) -> tuple[str, list[str]]:
    """``serve``'s one stderr line, and what it created in /dev/shm under the instance's
    name (the region, its key presence map) while it ran."""
    path = tmp_path / f"{cfg.name}.toml"
    path.write_text(config_to_toml(cfg))
    with ShmWatch() as watch:
        serve = subprocess.run([sys.executable, "-m", "tiercache", "serve", "--config",
                                str(path)], capture_output=True, text=True, timeout=TIMEOUT_S)
        created = [name for name in watch.created() if cfg.name in name]
    assert serve.returncode == 1, serve.stderr
    assert serve.stdout == "" and serve.stderr.count("\n") == 1, serve.stderr
    assert serve.stderr.startswith("tiercache: error: "), serve.stderr
    assert not os.path.lexists(cfg.socket_path)
    assert not [n for n in os.listdir("/dev/shm") if cfg.name in n]
    return serve.stderr, created


def a_config(make_config, **overrides):
    """A region of 64 MiB: created in milliseconds, were it created."""
    return make_config(kv=KVGeometry(page_bytes=(ROW,)),
                       region=RegionConfig(capacity_bytes=None, num_blocks=8192,
                                           prefault_threads=1), **overrides)


@pytest.fixture
def listening():
    """A port some other process listens on."""
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        yield other.getsockname()[1]


def test_a_taken_exporter_port_is_refused_before_the_region_exists(make_config, tmp_path,
                                                                   listening):
    cfg = a_config(make_config, exporter=ExporterConfig(port=listening))
    said, created = refused_start(cfg, tmp_path)
    assert created == []
    assert f"exporter.address/exporter.port = 127.0.0.1:{listening}: cannot listen there" in said
    assert "exporter.port = 0 for any free one" in said


@pytest.mark.parametrize("key", ["endpoint", "replay_endpoint"])
def test_a_taken_events_port_is_refused_before_the_region_exists(make_config, tmp_path,
                                                                 listening, key):
    endpoints = {"endpoint": "tcp://127.0.0.1:0", "replay_endpoint": "tcp://127.0.0.1:0"}
    endpoints[key] = f"tcp://127.0.0.1:{listening}"
    cfg = a_config(make_config, events=EventsConfig(**endpoints))
    said, created = refused_start(cfg, tmp_path)
    assert created == []
    assert f"events.{key} = 'tcp://127.0.0.1:{listening}': cannot bind it" in said


def test_a_non_ascii_digit_port_is_refused_at_config_load(make_config, tmp_path):
    """``'٥٥٥٥'.isdigit()`` is True and ``int('٥٥٥٥')`` is 5555: the port passed the check
    and went to ZMQ as written."""
    for key in ("endpoint", "replay_endpoint"):
        with pytest.raises(ConfigError, match=f"events.{key} = .*ASCII digits"):
            EventsConfig(**{"endpoint": "tcp://127.0.0.1:0", key: "tcp://127.0.0.1:٥٥٥٥"})
    with pytest.raises(ConfigError, match="cluster.master = .*ASCII digits"):
        ClusterConfig(master="127.0.0.1:٥٥٥٥", metadata_server="http://127.0.0.1:2/metadata",
                      local_hostname="127.0.0.1", key_file="k")
    cfg = a_config(make_config, events=EventsConfig(endpoint="tcp://127.0.0.1:0"))
    toml = config_to_toml(cfg)
    assert 'endpoint = "tcp://127.0.0.1:0"' in toml
    path = tmp_path / "c.toml"
    path.write_text(toml.replace('endpoint = "tcp://127.0.0.1:0"',
                                 'endpoint = "tcp://127.0.0.1:٥٥٥٥"'))
    serve = subprocess.run([sys.executable, "-m", "tiercache", "serve", "--config", str(path)],
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    assert serve.returncode == 1 and serve.stderr.count("\n") == 1, serve.stderr
    assert serve.stderr.startswith("tiercache: error: events.endpoint = "
                                   "'tcp://127.0.0.1:٥٥٥٥': port '٥٥٥٥'"), serve.stderr


def in_small_tmpfs(directory, argv: list[str]) -> subprocess.CompletedProcess:
    """``argv`` run with a 16 MiB tmpfs of its own on ``directory`` (a private mount
    namespace): a disk of known, small room (tmpfs undoes a failed fallocate whole, where
    a real disk may keep what it allocated before it ran out). Its stdout ends with a line
    ``left: NAMES``, what the tmpfs held after it (the tmpfs goes with the namespace)."""
    import shutil

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a private tmpfs")
    run = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f'mount -t tmpfs -o size={SMALL_DISK_BYTES},mode=0700 tmpfs "{directory}" || exit; '
         f'"$@"; rc=$?; echo "left: $(ls -A "{directory}")"; exit $rc', "sh", *argv],
        capture_output=True, text=True, timeout=TIMEOUT_S)
    if run.returncode != 0 and "mount" in run.stderr and "tiercache" not in run.stderr:
        pytest.skip(f"cannot mount a private tmpfs here: {run.stderr.strip()}")
    return run


def test_a_disk_capacity_beyond_the_free_room_leaves_no_file_and_no_region(make_config,
                                                                           tmp_path):
    disk_dir = tmp_path / "disk"
    disk_dir.mkdir()
    capacity = 4 * SMALL_DISK_BYTES
    cfg = a_config(make_config, disk=DiskConfig(path=str(disk_dir), capacity_bytes=capacity))
    path = tmp_path / f"{cfg.name}.toml"
    path.write_text(config_to_toml(cfg))
    with ShmWatch() as watch:
        serve = in_small_tmpfs(disk_dir, [sys.executable, "-m", "tiercache", "serve",
                                          "--config", str(path)])
        created = [name for name in watch.created() if cfg.name in name]
    assert serve.returncode == 1, serve.stderr
    assert serve.stdout == "left: \n"  # no empty tiercache-<name>.disk
    assert serve.stderr.count("\n") == 1, serve.stderr
    need = 4096 + capacity // (4096 + 2 * ROW) * (4096 + 2 * ROW)
    assert serve.stderr.startswith(f"tiercache: error: disk.capacity = {capacity} bytes: "
                                   f"{disk_dir}/tiercache-{cfg.name}.disk needs {need} bytes"
                                   ), serve.stderr
    assert f"its filesystem has {SMALL_DISK_BYTES} bytes (16.00 MiB) free" in serve.stderr
    assert created == []


_BACKSTOP_CHILD = """
import os, sys
from tiercache.errors import ConfigError
from tiercache.tiers.disk_file import HEADER_BYTES, DiskSlotFile

path = os.path.join(sys.argv[1], "tiercache-x.disk")
def make(capacity):
    DiskSlotFile(path, capacity, world_size=1, row_stride=4096, layout_digest=bytes(16)).close()
try:
    make(4 * int(sys.argv[2]))  # past the tmpfs: as if another tenant filled it after the check
except ConfigError as e:
    print("refused:", str(e).split(" (")[0], "| left:", os.listdir(sys.argv[1]))
make(4 * (HEADER_BYTES + 4096))
try:
    make(4 * int(sys.argv[2]))
except ConfigError as e:
    print("refused again | left:", os.listdir(sys.argv[1]))
"""


def test_a_disk_file_that_cannot_be_allocated_is_removed_when_this_start_made_it(tmp_path):
    """The backstop behind the free-room check: the file a failed start created goes with
    it; a file that was there before is kept, blocks and all."""
    disk_dir, script = tmp_path / "disk", tmp_path / "child.py"
    disk_dir.mkdir()
    script.write_text(_BACKSTOP_CHILD)
    run = in_small_tmpfs(disk_dir, [sys.executable, str(script), str(disk_dir),
                                    str(SMALL_DISK_BYTES)])
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == [
        f"refused: disk.capacity: cannot allocate {4096 + 4 * SMALL_DISK_BYTES // 8192 * 8192} "
        f"bytes in {disk_dir}/tiercache-x.disk | left: []",
        "refused again | left: ['tiercache-x.disk']", "left: tiercache-x.disk"]


def test_a_cluster_key_others_can_read_is_refused_before_the_region_exists(make_config,
                                                                           tmp_path):
    key = tmp_path / "cluster.key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o640)
    cfg = a_config(make_config, cluster=ClusterConfig(
        master="127.0.0.1:1", metadata_server="http://127.0.0.1:2/metadata",
        local_hostname="127.0.0.1", key_file=str(key)))
    said, created = refused_start(cfg, tmp_path)
    assert created == []
    assert f"cluster.key_file = '{key}' is a regular file owned by " in said
    assert "mode 0640" in said


def test_a_control_socket_another_process_serves_is_refused_before_the_region_exists(
        make_config, tmp_path):
    cfg = a_config(make_config, control_socket=str(tmp_path / "shared.sock"))
    with socket.socket(socket.AF_UNIX) as other:
        other.bind(cfg.socket_path)
        other.listen()
        path = tmp_path / f"{cfg.name}.toml"
        path.write_text(config_to_toml(cfg))
        with ShmWatch() as watch:
            serve = subprocess.run([sys.executable, "-m", "tiercache", "serve", "--config",
                                    str(path)], capture_output=True, text=True,
                                   timeout=TIMEOUT_S)
            created = [name for name in watch.created() if cfg.name in name]
        assert serve.returncode == 1 and serve.stderr.count("\n") == 1, serve.stderr
        assert f"control socket {cfg.socket_path!r} is served by a live process" in serve.stderr
        assert created == []
        assert os.path.exists(cfg.socket_path)  # the other process's: left alone
    os.unlink(cfg.socket_path)
