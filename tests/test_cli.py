"""`tiercache serve | status | clean` as a user runs them: real processes, real signals."""

import os
import re
import signal
import subprocess
import sys

import pytest

from tiercache.config import config_to_toml
from tiercache.link.client import Client
from tiercache.errors import CoordinatorGoneError
from tiercache.region.stale import list_regions
from tiercache.service.process import CoordinatorProcess


def tiercache(*args: str, timeout_s: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tiercache", *args], capture_output=True,
                          text=True, timeout=timeout_s)


def test_serve_reports_each_step_answers_status_and_cleans_up_on_sigterm(make_config, tmp_path):
    cfg = make_config()
    coord = CoordinatorProcess(cfg, tmp_path)
    out = coord.output()
    for step in ("allocated", "pre-faulted the header in", "pins its own slice (2 threads)", "control socket", "metrics: http",
                 "ready in"):
        assert step in out
    status = tiercache("status", "--config", str(coord.config_path))
    assert status.returncode == 0, status.stderr
    assert f"region {cfg.name}" in status.stdout and "live" in status.stdout
    assert "state ready, generation 1" in status.stdout
    assert "rank 1: no worker" in status.stdout and "pre-faulted in 0.00 s" in status.stdout
    assert "index: 0 ready, 0 writing, 0 loading, 16 free of 16" in status.stdout
    assert os.stat(cfg.socket_path).st_mode & 0o777 == 0o600
    assert coord.stop() == 0
    assert (f"stopped; removed region /dev/shm/tiercache-{cfg.name} and socket "
            f"{cfg.socket_path}") in coord.output()
    assert not os.path.exists(f"/dev/shm/tiercache-{cfg.name}")
    assert not os.path.exists(cfg.socket_path)
    coord.cleanup()


def test_sigint_stops_like_ctrl_c(make_config, tmp_path):
    coord = CoordinatorProcess(make_config(), tmp_path)
    coord.proc.send_signal(signal.SIGINT)
    assert coord.proc.wait(30) == 0
    assert "SIGINT: shutting down" in coord.output()
    assert not os.path.exists(coord.config.socket_path)
    coord.cleanup()


def _stop_with(sig: signal.Signals, cfg, workdir) -> tuple:
    """A real `tiercache serve` stopped by ``sig``: exit status, what it printed after the
    signal's line, whether its region and its socket are still there."""
    coord = CoordinatorProcess(cfg, workdir)
    try:
        coord.proc.send_signal(sig)
        returncode = coord.proc.wait(30)
        said = coord.output().partition(f" tiercache.serve: {sig.name}: shutting down\n")
        return (returncode, said[2] if said[1] else None,
                os.path.exists(f"/dev/shm/{cfg.shm_name}"), os.path.exists(cfg.socket_path))
    finally:
        coord.cleanup()


def test_sighup_stops_serve_exactly_as_sigterm_does(make_config, tmp_path):
    """The terminal closing (SIGHUP) used to kill serve without its shutdown."""
    cfg = make_config()
    on_sigterm = _stop_with(signal.SIGTERM, cfg, tmp_path / "term")
    assert on_sigterm[0] == 0 and " tiercache.serve: stopped; removed region" in on_sigterm[1]
    on_sighup = _stop_with(signal.SIGHUP, cfg, tmp_path / "hup")
    assert on_sighup[0] == 0 and " tiercache.serve: stopped; removed region" in on_sighup[1]
    assert on_sighup[2:] == on_sigterm[2:]


def test_second_serve_of_the_same_name_is_refused_and_the_first_keeps_running(make_config,
                                                                             tmp_path):
    cfg = make_config()
    with CoordinatorProcess(cfg, tmp_path / "a") as first:
        result = tiercache("serve", "--config", str(first.config_path))
        assert result.returncode == 1
        assert f"belongs to a live coordinator (pid {first.pid})" in result.stderr
        # refused before it made anything (tiercache.service.preflight): the error is all
        assert result.stderr.count("\n") == 1 and result.stdout == "", result.stderr
        with Client(cfg) as client:
            assert client.lookup([b"k"]) == 0


def test_sigkilled_coordinator_is_reclaimed_by_serve_and_clients_reconnect(make_config, tmp_path):
    cfg = make_config()
    first = CoordinatorProcess(cfg, tmp_path / "a")
    client = Client(cfg, timeout_s=5)
    out = client.prepare_store([b"a", b"b"])
    assert out is not None
    first.kill()
    with pytest.raises(CoordinatorGoneError):
        client.lookup([b"a"])
    status = tiercache("status", "--name", cfg.name)
    assert "STALE" in status.stdout
    with CoordinatorProcess(cfg, tmp_path / "b") as second:
        assert "re-adopted stale region" in second.output()
        assert "generation 2" in second.output()
        # the client's session (its process lives) resumes with its reservations: the
        # rebuilt index kept "a" and "b" being written, and its completion publishes them
        assert client.lookup([b"a"]) == 0
        assert client.prepare_store([b"a"]).keys_to_store == ()  # still reserved, not new
        client.complete_store([b"a", b"b"])
        assert client.lookup([b"a", b"b"]) == 2
    client.close()
    first.cleanup()


@pytest.mark.serial  # `clean` without a name: every stale region on the machine
def test_clean_removes_stale_regions_and_never_a_live_one(make_config, tmp_path):
    dead_cfg, live_cfg = make_config(), make_config(name=make_config().name + "x",
                                                    control_socket=str(tmp_path / "live.sock"))
    dead = CoordinatorProcess(dead_cfg, tmp_path / "dead")
    dead.kill()
    with CoordinatorProcess(live_cfg, tmp_path / "live"):
        dry = tiercache("clean", "--dry-run")
        assert f"would remove stale region /dev/shm/tiercache-{dead_cfg.name}" in dry.stdout
        assert os.path.exists(f"/dev/shm/tiercache-{dead_cfg.name}")
        result = tiercache("clean")
        assert result.returncode == 0
        assert f"removed stale region /dev/shm/tiercache-{dead_cfg.name}" in result.stdout
        assert f"kept live region /dev/shm/tiercache-{live_cfg.name}" in result.stdout
        names = {r.name: r.live for r in list_regions()}
        assert dead_cfg.name not in names and names[live_cfg.name] is True
    dead.cleanup()


def test_bad_config_is_one_clear_error_and_nothing_is_created(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text('[instance]\nname = "x"\n[region]\ncapacity = "lots"\n')
    result = tiercache("serve", "--config", str(bad))
    assert result.returncode == 1
    assert result.stderr.strip().splitlines() == [
        "tiercache: error: region.capacity = 'lots': expected a byte count or a size such as "
        "'256MiB', '8GiB', '1.5GB' (units: b, kib, mib, gib, tib, kb, mb, gb, tb)"]
    assert not os.path.exists("/dev/shm/tiercache-x")


def test_status_for_a_missing_name_is_an_error_on_stderr():
    result = tiercache("status", "--name", "surely-not-there")
    assert result.returncode == 1 and result.stdout == ""
    assert result.stderr == "tiercache: error: no tiercache region named surely-not-there\n"


def test_clean_removes_the_stale_socket_too_and_takes_a_name(make_config, tmp_path):
    dead_cfg, other_cfg = make_config(), make_config(name=make_config().name + "y",
                                                     control_socket=str(tmp_path / "y.sock"))
    CoordinatorProcess(dead_cfg, tmp_path / "dead").kill()
    CoordinatorProcess(other_cfg, tmp_path / "other").kill()
    assert os.path.exists(dead_cfg.socket_path)  # a SIGKILLed coordinator leaves both
    config_path = tmp_path / "dead.toml"
    config_path.write_text(config_to_toml(dead_cfg))
    result = tiercache("clean", "--config", str(config_path))
    assert result.returncode == 0, result.stderr
    assert f"removed stale region /dev/shm/tiercache-{dead_cfg.name}" in result.stdout
    assert f"removed stale socket {dead_cfg.socket_path}" in result.stdout
    assert not os.path.exists(dead_cfg.socket_path)
    assert not os.path.exists(f"/dev/shm/tiercache-{dead_cfg.name}")
    assert os.path.exists(f"/dev/shm/tiercache-{other_cfg.name}")  # not named: kept
    by_name = tiercache("clean", "--name", other_cfg.name)  # socket: the path its header records
    assert f"removed stale region /dev/shm/tiercache-{other_cfg.name}" in by_name.stdout
    assert f"removed stale socket {other_cfg.socket_path}" in by_name.stdout
    assert not os.path.exists(f"/dev/shm/tiercache-{other_cfg.name}")
    assert not os.path.exists(other_cfg.socket_path)


def test_help_is_plain_text():
    for args in (["-h"], ["serve", "-h"], ["status", "-h"], ["clean", "-h"]):
        result = tiercache(*args)
        assert result.returncode == 0 and "`" not in result.stdout, result.stdout


def test_log_level_goes_before_or_after_the_subcommand():
    for args in (["--log-level", "DEBUG", "status", "--name", "x-none"],
                 ["status", "--name", "x-none", "--log-level", "DEBUG"]):
        result = tiercache(*args)
        assert result.returncode == 1 and "no tiercache region named x-none" in result.stderr
    bad = tiercache("status", "--log-level", "LOUD")
    assert bad.returncode == 2 and "invalid choice: 'LOUD'" in bad.stderr


@pytest.mark.parametrize("kind", ["binary", "directory"])
def test_a_config_that_is_not_a_toml_file_is_one_line(tmp_path, kind):
    path = tmp_path / "config.toml"
    if kind == "binary":
        path.write_bytes(bytes(range(256)) * 4)
    else:
        path.mkdir()
    for command in ("serve", "status", "clean"):
        result = tiercache(command, "--config", str(path))
        assert result.returncode == 1, result.stderr
        assert result.stderr.startswith(f"tiercache: error: config file '{path}' ")
        assert result.stderr.count("\n") == 1, result.stderr


@pytest.mark.parametrize("events", [True, False])
def test_index_events_are_served_when_the_config_enables_them(make_config, tmp_path, events):
    from tiercache.errors import StateError

    cfg = make_config(index_events=events)
    with CoordinatorProcess(cfg, tmp_path), Client(cfg) as client:
        out = client.prepare_store([b"k1", b"k2"])
        client.complete_store(list(out.keys_to_store))
        if events:
            taken = client.take_events()
            assert [sorted(e.keys) for e in taken] == [[b"k1", b"k2"]]
            assert client.take_events() == []
        else:
            with pytest.raises(StateError, match="events"):
                client.take_events()


def test_status_reports_a_stats_block_left_mid_update_instead_of_a_traceback(make_config):
    from tiercache.region.shared import SharedOffloadRegion

    cfg = make_config()
    region = SharedOffloadRegion.create(cfg)
    try:
        region.stats(1)._words[0] += 1  # its writer died between the two sequence bumps
        result = tiercache("status", "--name", cfg.name)
        assert result.returncode == 0, result.stderr
        assert "rank 1: stats block left mid-update" in result.stdout
        assert "rank 0: no worker" in result.stdout
    finally:
        region.close()


def test_coordinator_keeps_the_mapping_when_the_exporter_cannot_drain(make_config, monkeypatch):
    from tiercache.errors import ServiceError
    from tiercache.service.coordinator import Coordinator

    coordinator = Coordinator(make_config(), say=lambda _: None)
    coordinator.start()
    region, exporter = coordinator.region, coordinator.exporter
    real_close = exporter.close

    def stuck_close():
        real_close()
        raise ServiceError("a scrape did not finish")

    monkeypatch.setattr(exporter, "close", stuck_close)
    with pytest.raises(ServiceError):
        coordinator.close()
    assert not os.path.exists(region.path)  # unlinked ...
    assert region._mmap is not None  # ... but still mapped for the scrape that may read it
    region._release_mapping()


def test_status_into_a_closed_pipe_exits_quietly(make_config):
    from tiercache.region.shared import SharedOffloadRegion

    cfg = make_config(world_size=8)
    region = SharedOffloadRegion.create(cfg)
    try:
        result = subprocess.run(f"{sys.executable} -m tiercache status | head -1", shell=True,
                                capture_output=True, text=True)
        assert result.stdout.startswith("region ")
        assert "Traceback" not in result.stderr and "BrokenPipe" not in result.stderr
    finally:
        region.close()


@pytest.mark.parametrize("flag", ["--name", "--config"])
def test_an_empty_name_or_config_is_an_error_not_every_instance(flag, make_config):
    """`clean --name ''` used to clean every instance (an empty name read as no name)."""
    from tiercache.region.shared import SharedOffloadRegion

    cfg = make_config()
    # a region clean would remove once this process (its header's coordinator) is gone
    SharedOffloadRegion.create(cfg).close(unlink=False)
    try:
        # the dry run first: before the fix it only lists what would go
        for args in (["clean", "--dry-run"], ["status"], ["clean"]):
            result = tiercache(*args, flag, "")
            assert result.returncode == 1 and result.stdout == "", (args, result.stdout)
            assert result.stderr.count("\n") == 1, result.stderr
            assert result.stderr.startswith("tiercache: error: --name = '': 1-64 characters"
                                            if flag == "--name" else
                                            "tiercache: error: config file '': an empty path")
        assert os.path.exists(f"/dev/shm/{cfg.shm_name}")  # nothing removed
    finally:
        os.unlink(f"/dev/shm/{cfg.shm_name}")


def test_a_relative_control_socket_is_relative_to_the_config_file(make_config, tmp_path,
                                                                  monkeypatch):
    """serve, status and Client(config) run from different directories used to resolve a
    relative control.socket each against their own: status found no index, clients no
    coordinator."""
    import time

    from tiercache.config import load_config
    from tiercache.service.process import READY_MARKER

    conf_dir, serve_dir, other_dir = (tmp_path / d for d in ("conf", "serve", "other"))
    for d in (conf_dir, serve_dir, other_dir):
        d.mkdir()
    config_path = conf_dir / "c.toml"
    toml = config_to_toml(make_config(control_socket=""))
    config_path.write_text(toml.replace('socket = ""', 'socket = "ctl.sock"'))
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log:
        serve = subprocess.Popen([sys.executable, "-m", "tiercache", "serve", "--config",
                                  str(config_path)], cwd=serve_dir, stdout=log,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while READY_MARKER not in log_path.read_text():
            assert serve.poll() is None and time.monotonic() < deadline, log_path.read_text()
            time.sleep(0.02)
        assert os.path.exists(conf_dir / "ctl.sock") and not os.path.exists(serve_dir / "ctl.sock")
        status = subprocess.run([sys.executable, "-m", "tiercache", "status", "--config",
                                 str(config_path)], cwd=other_dir, capture_output=True,
                                text=True)
        assert status.returncode == 0, status.stderr
        assert "index: 0 ready, 0 writing" in status.stdout, status.stdout
        monkeypatch.chdir(other_dir)
        config = load_config(config_path)
        assert config.control_socket == str(conf_dir / "ctl.sock")
        with Client(config, timeout_s=5) as client:
            assert client.lookup([b"k"]) == 0
    finally:
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(30) == 0, log_path.read_text()
    assert "stopped; removed region" in log_path.read_text()


def test_version_is_the_installed_distributions():
    from importlib.metadata import version

    result = tiercache("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout == f"tiercache {version('tiercache')}\n"
    import tiercache as package

    assert package.__version__ == version("tiercache")  # one source: pyproject.toml


def test_python_m_tiercache_is_the_tiercache_command_and_importing_it_runs_nothing():
    """``import tiercache.__main__`` (pydoc, a module walker) used to run the command."""
    script = os.path.join(os.path.dirname(sys.executable), "tiercache")
    for args in (["--version"], ["status", "--name", "x-none"], []):
        as_module = tiercache(*args)
        as_script = subprocess.run([script, *args], capture_output=True, text=True)
        assert (as_module.returncode, as_module.stdout, as_module.stderr) == (
            as_script.returncode, as_script.stdout, as_script.stderr), args
    imported = subprocess.run([sys.executable, "-c", "import tiercache.__main__"],
                              capture_output=True, text=True)
    assert (imported.returncode, imported.stdout, imported.stderr) == (0, "", "")


def test_help_lists_every_command_from_the_parser():
    """The description listed serve, status, clean, bench, demo by hand: not the
    config-for-* commands."""
    from tiercache.cli import build_parser

    commands = list(build_parser()._subparsers._group_actions[0].choices)  # type: ignore
    assert {"serve", "status", "clean", "bench", "demo", "config-for-vllm",
            "config-for-sglang"} <= set(commands)
    text = tiercache("-h").stdout
    listed = text.split("\ncommands:\n", 1)[1]
    for command in commands:
        assert re.search(rf"^    {re.escape(command)}\s+\S", listed, re.M), (command, text)
    assert "Commands: serve" not in text


def test_status_after_a_clean_detach_says_so_and_not_down(make_config):
    from tiercache.region.hostmem import process_start_ns
    from tiercache.region.shared import SharedOffloadRegion

    cfg = make_config()
    region = SharedOffloadRegion.create(cfg)
    try:
        worker = SharedOffloadRegion.attach(cfg.name, 1)
        worker.stats(1).mark_attached(os.getpid(), process_start_ns(os.getpid()))
        worker.stats(1).mark_detached()  # what Worker.close does
        worker.close()
        result = tiercache("status", "--name", cfg.name)
        assert result.returncode == 0, result.stderr
        assert "rank 1: no worker (every worker detached cleanly), attached 1x" in result.stdout
        assert "DOWN" not in result.stdout and "rank 0: no worker," in result.stdout
    finally:
        region.close()


def test_status_of_a_stale_region_says_serve_re_adopts_it(make_config, tmp_path):
    cfg = make_config()
    coordinator = CoordinatorProcess(cfg, tmp_path)
    coordinator.kill()  # SIGKILL: its READY region stays, stale
    try:
        result = tiercache("status", "--name", cfg.name)
        assert result.returncode == 0, result.stderr
        assert ("  stale: `tiercache serve` with the same geometry re-adopts it warm (its "
                "cache, the engines' mappings and pins kept); `tiercache clean` removes it\n"
                ) in result.stdout
    finally:
        coordinator.cleanup()
