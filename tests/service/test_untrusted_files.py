"""Files under a region's name that tiercache must not trust: other file types, other
owners, other modes. ``serve``, ``status`` and ``clean`` run as real processes (with a
timeout: a FIFO used to hang them) and must answer with one line, never a traceback."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import pytest

from tiercache.config import config_to_toml
from tiercache.errors import ServiceError
from tiercache.region.presence import remove_stale_presence
from tiercache.service.process import CoordinatorProcess

import users

CLI_TIMEOUT_S = 30


def tiercache(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tiercache", *args], capture_output=True,
                          text=True, timeout=CLI_TIMEOUT_S)


@pytest.fixture(scope="module")
def other_user():
    yield from users.other_user()


def _write_config(cfg, tmp_path) -> str:
    path = tmp_path / f"{cfg.name}.toml"
    path.write_text(config_to_toml(cfg))
    return str(path)


def _make_entry(kind: str, path: str, tmp_path) -> None:
    if kind == "fifo":
        os.mkfifo(path, 0o600)
    elif kind == "directory":
        os.mkdir(path, 0o700)
    elif kind == "symlink":  # to a file of ours: following it would be the attack
        target = tmp_path / "target"
        target.write_bytes(b"\0" * 8192)
        os.symlink(target, path)
    elif kind == "device":
        if os.geteuid() != 0:
            pytest.skip("mknod needs root")
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))  # /dev/null's numbers
    else:
        raise AssertionError(kind)


def _remove_entry(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        os.rmdir(path)
    elif os.path.lexists(path):
        os.unlink(path)


KIND_WORDS = {"fifo": "a FIFO", "directory": "a directory", "symlink": "a symlink",
              "device": "a character device"}


@pytest.mark.serial  # `clean` without a name: every stale region on the machine
@pytest.mark.parametrize("kind", list(KIND_WORDS))
def test_a_non_file_named_like_a_region_neither_hangs_nor_crashes_status_clean_serve(
        kind, make_config, tmp_path):
    cfg = make_config()
    path = f"/dev/shm/{cfg.shm_name}"
    _make_entry(kind, path, tmp_path)
    try:
        status = tiercache("status")
        assert status.returncode == 0, status.stderr
        assert "Traceback" not in status.stderr
        line = [s for s in status.stdout.splitlines() if cfg.name in s]
        assert len(line) == 1 and KIND_WORDS[kind] in line[0] and "not a region" in line[0]

        named = tiercache("status", "--name", cfg.name)
        assert named.returncode == 1 and named.stdout == ""
        assert named.stderr.count("\n") == 1 and KIND_WORDS[kind] in named.stderr

        clean = tiercache("clean")
        assert clean.returncode == 0, clean.stderr
        assert f"left {path} alone: {KIND_WORDS[kind]}" in clean.stdout
        assert os.path.lexists(path)  # not ours to judge: clean never removes it

        serve = tiercache("serve", "--config", _write_config(cfg, tmp_path))
        assert serve.returncode == 1
        assert serve.stderr.startswith(f"tiercache: error: {path} is {KIND_WORDS[kind]}")
        assert serve.stderr.count("\n") == 1, serve.stderr
        assert serve.stdout == ""  # it created nothing, so it removed nothing
        assert os.path.lexists(path)
    finally:
        _remove_entry(path)


def _stale_region(make_config, tmp_path):
    """A region whose coordinator was SIGKILLed (same geometry: serve would re-adopt it)."""
    cfg = make_config()
    CoordinatorProcess(cfg, tmp_path / "dead").kill()
    remove_stale_presence(cfg.name)  # its key presence map: these tests are about the region
    return cfg, f"/dev/shm/{cfg.shm_name}"


def test_serve_does_not_readopt_a_region_with_another_mode(make_config, tmp_path):
    cfg, path = _stale_region(make_config, tmp_path)
    os.chmod(path, 0o666)
    serve = tiercache("serve", "--config", _write_config(cfg, tmp_path))
    assert serve.returncode == 1
    me = f"uid {os.geteuid()}"
    assert serve.stderr.startswith(f"tiercache: error: {path} is a regular file owned by ")
    assert me in serve.stderr and "mode 0666" in serve.stderr and "mode 0600" in serve.stderr
    assert serve.stderr.count("\n") == 1 and serve.stdout == ""
    assert os.stat(path).st_mode & 0o777 == 0o666  # left as found, for the user to inspect
    os.unlink(path)


@pytest.mark.serial  # `clean` without a name: every stale region on the machine
def test_serve_does_not_readopt_a_region_another_user_owns(make_config, tmp_path, other_user):
    cfg, path = _stale_region(make_config, tmp_path)
    other_user.own(path)  # as if that user had left it there for us to adopt
    serve = tiercache("serve", "--config", _write_config(cfg, tmp_path))
    assert serve.returncode == 1
    assert f"owned by {other_user.name} (uid {other_user.uid})" in serve.stderr
    assert serve.stderr.count("\n") == 1 and serve.stdout == ""
    status = tiercache("status")
    assert f"owned by {other_user.name}" in status.stdout
    clean = tiercache("clean")
    assert f"left {path} alone" in clean.stdout and os.path.exists(path)
    os.unlink(path)


def test_another_user_gets_one_line_errors_for_our_region(make_config, tmp_path, other_user):
    """The other user cannot open our 0600 region: serve, status and clean say so in one
    line (they used to print a PermissionError traceback, or ignore the region)."""
    their = users.shared_dir(other_user)
    try:
        cfg = make_config()  # our socket in our directory; their copy of the config in theirs
        with CoordinatorProcess(cfg, tmp_path):
            path = f"/dev/shm/{cfg.shm_name}"
            config_path = os.path.join(their.name, "c.toml")
            with open(config_path, "w") as f:
                f.write(config_to_toml(cfg))
            serve = other_user.tiercache("serve", "--config", config_path)
            assert serve.returncode == 1, serve.stderr
            assert serve.stderr.startswith(f"tiercache: error: {path} is a regular file owned by ")
            assert serve.stderr.count("\n") == 1, serve.stderr
            status = other_user.tiercache("status", "--name", cfg.name)
            assert status.returncode == 1 and status.stderr.count("\n") == 1, status.stderr
            assert "owned by root (uid 0)" in status.stderr
            clean = other_user.tiercache("clean", "--name", cfg.name)
            assert clean.returncode == 0, clean.stderr
            assert f"left {path} alone" in clean.stdout and os.path.exists(path)
    finally:
        their.cleanup()


@pytest.mark.parametrize("size_bytes", [4096, 100])
def test_a_truncated_stale_region_is_one_line_for_status_and_attach_and_serve_replaces_it(
        size_bytes, make_config, tmp_path):
    """A stale region cut short (4096: the header survives and says the region is larger;
    100: shorter than the header) used to make status, attach and serve die with mmap's
    ValueError, or be taken for a region still being created."""
    from tiercache.errors import RegionTruncatedError
    from tiercache.region.shared import SharedOffloadRegion

    cfg, path = _stale_region(make_config, tmp_path)
    total_bytes = os.stat(path).st_size
    os.truncate(path, size_bytes)
    said = (f"truncated: {size_bytes} bytes, header says {total_bytes}" if size_bytes == 4096
            else f"truncated: {size_bytes} bytes, less than the 4096-byte header")
    other = SharedOffloadRegion.create(make_config(name=cfg.name + "z"))  # listed after it
    try:
        status = tiercache("status")
        assert status.returncode == 0 and "Traceback" not in status.stderr, status.stderr
        lines = [s for s in status.stdout.splitlines() if s.startswith(f"region {cfg.name} ")]
        assert len(lines) == 1 and said in lines[0] and "STALE" in lines[0], status.stdout
        assert f"region {cfg.name}z " in status.stdout  # it went on to the next instance
        assert "rank 1: no worker" in status.stdout.split(f"region {cfg.name}z ", 1)[1]

        named = tiercache("status", "--name", cfg.name)
        assert named.returncode == 1 and named.stdout == ""
        assert named.stderr.count("\n") == 1 and said in named.stderr, named.stderr

        with pytest.raises(RegionTruncatedError, match=f"{path} is {said}: it cannot be mapped"):
            SharedOffloadRegion.attach(cfg.name, 0)

        dry = tiercache("clean", "--dry-run", "--name", cfg.name)
        assert f"would remove stale region {path}" in dry.stdout, dry.stdout
    finally:
        other.close()
    with CoordinatorProcess(cfg, tmp_path / "again") as serve:  # stale and unusable: replaced
        assert f"replacing stale region {path} (owner pid " in serve.output()
        assert f"is gone; {said})" in serve.output()
        assert os.stat(path).st_size == total_bytes
        SharedOffloadRegion.attach(cfg.name, 0).close()


# ---------------------------------------------------------------------- the key presence map
def _squat(kind: str, path: str, user, tmp_path) -> str:
    """Another user's entry under the map's name; returns the words status/serve use."""
    if kind == "fifo":
        made = user.run(["mkfifo", "-m", "0644", path])
        words = "a FIFO"
    elif kind == "file":  # long enough, right mode: only its owner gives it away
        made = user.run(["sh", "-c", f"umask 077; head -c 131136 /dev/zero > {path}"])
        words = "a regular file"
    else:  # a link to a map-shaped file of ours: following it would be the attack
        target = tmp_path / "map-copy"
        target.write_bytes(b"TCKEYS01" + b"\1\0\0\0\1\0\0\0" + (1 << 16).to_bytes(8, "little")
                           + bytes(40) + bytes(1 << 16))
        target.chmod(0o600)
        made = user.run(["ln", "-s", str(target), path])
        words = "a symlink"
    assert made.returncode == 0, made.stderr
    return f"{words} owned by {user.name} (uid {user.uid})"


@pytest.mark.parametrize("kind", ["fifo", "file", "symlink"])
def test_another_users_entry_under_the_maps_name_blocks_no_engine_serve_or_clean(
        kind, make_config, tmp_path, other_user):
    """While no map exists (after a clean stop), another user squats its name. A running
    scheduler's refresh used to block forever in open() on a FIFO, a new engine at start,
    serve and clean with it; now each answers at once, naming the squatter."""
    from presence_reader import PresenceReader

    from tiercache.region.presence import presence_path

    cfg = make_config()
    path = presence_path(cfg.name)
    coordinator = CoordinatorProcess(cfg, tmp_path / "c")
    running = PresenceReader(cfg.name)  # a scheduler reading the live map
    try:
        assert running.opened == "open True None"
        assert coordinator.stop() == 0 and not os.path.lexists(path)
        squatter = _squat(kind, path, other_user, tmp_path)

        answer = running.ask("refresh")  # the scheduler's next step
        assert answer.startswith(f"refresh False {path} is {squatter}"), answer
        assert running.ask("maybe " + b"key".hex()) == "maybe True"  # asks the coordinator

        starting = PresenceReader(cfg.name)  # a new engine
        assert starting.opened.startswith(f"open False {path} is {squatter}"), starting.opened
        assert starting.close() == 0

        serve = tiercache("serve", "--config", _write_config(cfg, tmp_path))
        assert serve.returncode == 1, serve.stdout
        assert serve.stderr.startswith(f"tiercache: error: {path} is {squatter}"), serve.stderr
        assert serve.stderr.count("\n") == 1, serve.stderr
        assert not os.path.exists(f"/dev/shm/{cfg.shm_name}")  # nothing half-made stays

        status = tiercache("status", "--name", cfg.name)
        assert status.returncode == 0, status.stderr
        [line] = [s for s in status.stdout.splitlines() if path in s]
        assert "NOT USABLE" in line and squatter in line, line

        clean = tiercache("clean", "--name", cfg.name)
        assert clean.returncode == 0, clean.stderr
        assert f"left {path} alone: {squatter}" in clean.stdout, clean.stdout
        assert os.path.lexists(path)  # not ours to judge
    finally:
        running.close()
        coordinator.kill()
        _remove_entry(path)
        coordinator.cleanup()


# ---------------------------------------------------------------------- what clean may remove
OLD_S = 3600  # older than a region mid-creation could be (tiercache.region.stale.YOUNG_S)


def test_clean_never_removes_a_file_of_ours_without_a_region_header(make_config):
    """A file of ours under a region's name that is no region (a tier's data file put in
    /dev/shm, another program's): its lock is free and it is old, and clean used to
    unlink it as a STALE region. Only what starts with a region header is removed."""
    cfg = make_config(name=make_config().name + ".disk")
    path = f"/dev/shm/{cfg.shm_name}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    try:
        os.write(fd, b"TCDISK01" + os.urandom(1 << 16))
        os.utime(path, (os.stat(path).st_atime - OLD_S, os.stat(path).st_mtime - OLD_S))
        for args in (["clean", "--dry-run"], ["clean"]):
            clean = tiercache(*args, "--name", cfg.name)
            assert clean.returncode == 0, clean.stderr
            assert f"left {path} alone: a regular file owned by " in clean.stdout, clean.stdout
            assert "no region header" in clean.stdout and "would remove" not in clean.stdout
        assert os.path.exists(path)
        status = tiercache("status", "--name", cfg.name)
        assert status.returncode == 1 and status.stdout == "", status.stdout
        assert "no region header" in status.stderr and status.stderr.count("\n") == 1
    finally:
        os.close(fd)
        os.unlink(path)


def test_clean_leaves_the_disk_file_of_a_live_coordinator_in_dev_shm(make_config, tmp_path):
    """Issue 33: with ``disk.path = /dev/shm`` the disk file (``tiercache-<name>.disk``) was
    listed as a STALE region and unlinked under the running coordinator. Either serve
    refuses that directory in one line, or clean and status leave the file alone."""
    from tiercache.config import DiskConfig

    cfg = make_config(disk=DiskConfig(path="/dev/shm", capacity_bytes=1 << 20))
    coordinator = None
    disk_path = f"/dev/shm/tiercache-{cfg.name}.disk"
    try:
        try:
            coordinator = CoordinatorProcess(cfg, tmp_path / "c")
        except ServiceError as e:  # the disk tier's own rule may refuse /dev/shm
            assert "disk.path" in str(e) and "Traceback" not in str(e), e
            assert not os.path.exists(disk_path)
            return
        assert os.path.exists(disk_path)
        os.utime(disk_path, (os.stat(disk_path).st_atime - OLD_S,
                             os.stat(disk_path).st_mtime - OLD_S))
        clean = tiercache("clean", "--name", f"{cfg.name}.disk")
        assert clean.returncode == 0 and "removed" not in clean.stdout, clean.stdout
        assert os.path.exists(disk_path)
        status = tiercache("status", "--name", f"{cfg.name}.disk")
        assert "STALE" not in status.stdout + status.stderr
        assert coordinator.stop() == 0
    finally:
        if coordinator is not None:
            coordinator.cleanup()
        if os.path.exists(disk_path):
            os.unlink(disk_path)


def test_clean_leaves_a_region_whose_recorded_coordinator_still_runs(make_config):
    """A free lock is not proof enough while the coordinator the header names still runs
    (one that closed its region without removing it, and has not exited): clean leaves it,
    and removes it once that process is gone (SIGKILL)."""
    from tiercache.config import config_to_toml

    cfg = make_config()
    path = f"/dev/shm/{cfg.shm_name}"
    child = subprocess.Popen([sys.executable, "-c", "import sys, spawned; "
                              "spawned.close_region_and_live_on(sys.stdin.read())"],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                 [os.path.dirname(users.__file__),
                                  os.environ.get("PYTHONPATH", "")])})
    try:
        child.stdin.write(config_to_toml(cfg))
        child.stdin.close()
        assert child.stdout.readline() == "closed\n"
        clean = tiercache("clean", "--name", cfg.name)
        assert f"left {path} alone: " in clean.stdout, clean.stdout
        assert f"(pid {child.pid}) still runs" in clean.stdout and os.path.exists(path)
        child.kill()
        child.wait()
        clean = tiercache("clean", "--name", cfg.name)
        assert f"removed stale region {path}" in clean.stdout, clean.stdout
        assert not os.path.exists(path)
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
        if os.path.exists(path):
            os.unlink(path)
