"""deploy/systemd: the units pass ``systemd-analyze verify`` (against this host's own
systemd units, in a scratch root where the binaries they run exist), and what they say
agrees with what the coordinator needs: the config the unit names loads, its control
socket lies in the unit's runtime directory, its disk tier in the cache directory, the
engines run as the coordinator's user, after it, and never stop with it."""

from __future__ import annotations

import configparser
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest

from tiercache.config import config_from_dict

REPO = Path(__file__).resolve().parents[2]
UNITS = REPO / "deploy" / "systemd"
HOST_UNITS = Path("/usr/lib/systemd/system")
INSTANCE = "node"


def _analyze() -> str:
    tool = shutil.which("systemd-analyze")
    if tool is None:  # `make test` installs it (`make systemd`): a missing check is a failure
        pytest.fail("systemd-analyze is missing: `make systemd` installs Debian's systemd")
    return tool


def _unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None,
                                       delimiters=("=",), comment_prefixes=("#",))
    parser.optionxform = str  # keys are case-sensitive
    parser.read(UNITS / name)
    return parser


def _scratch_root(tmp_path: Path) -> Path:
    """A root with the host's systemd units, our units (and one instance of each), and
    the binaries ExecStart names (where an operator installs them)."""
    root = tmp_path / "root"
    shutil.copytree(HOST_UNITS, root / HOST_UNITS.relative_to("/"), symlinks=True)
    system = root / "etc" / "systemd" / "system"
    system.mkdir(parents=True)
    for unit in UNITS.glob("*.service"):
        shutil.copy(unit, system / unit.name)
        (system / unit.name.replace("@.", f"@{INSTANCE}.")).symlink_to(unit.name)
    for name in ("tiercache@.service", "vllm@.service"):
        binary = _unit(name)["Service"]["ExecStart"].split()[0]
        path = root / binary.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("#!/bin/sh\n")
        path.chmod(0o755)
    return root


def test_the_units_verify_with_no_complaint(tmp_path):
    root = _scratch_root(tmp_path)
    units = [f"/etc/systemd/system/{u.name.replace('@.', f'@{INSTANCE}.')}"
             for u in UNITS.glob("*.service")]
    out = subprocess.run([_analyze(), "verify", "--man=no", "--generators=no",
                          f"--root={root}", *units], capture_output=True, text=True)
    # verify exits 0 on warnings (an unknown key is "ignoring"): any line is a complaint
    assert out.returncode == 0 and not out.stdout.strip() and not out.stderr.strip(), (
        out.returncode, out.stdout, out.stderr)


def test_verify_catches_a_broken_unit(tmp_path):
    """The check above can fail: a misspelt key is reported."""
    root = _scratch_root(tmp_path)
    unit = root / "etc" / "systemd" / "system" / "tiercache@.service"
    unit.write_text(unit.read_text().replace("LimitMEMLOCK=", "LimitMEMLOK="))
    out = subprocess.run([_analyze(), "verify", "--man=no", "--generators=no",
                          f"--root={root}", f"/etc/systemd/system/tiercache@{INSTANCE}.service"],
                         capture_output=True, text=True)
    assert "LimitMEMLOK" in out.stderr


def test_the_coordinator_unit_keeps_the_cache_warm_and_its_socket_where_the_config_says(
        tmp_path):
    service = _unit("tiercache@.service")["Service"]
    assert service["Type"] == "notify"  # `serve` sends READY=1 (tests/service/test_notify.py)
    assert service["Restart"] == "always"  # a crash restarts it; it re-adopts the region
    assert service.get("RemoveIPC", "no") == "no" and "DynamicUser" not in service
    assert service.get("PrivateDevices", "no") == "no"  # /dev/shm is where the cache lives
    assert service["RuntimeDirectoryPreserve"] in ("restart", "yes")
    assert service["LimitMEMLOCK"] == "infinity"
    config_path = service["ExecStart"].split("--config", 1)[1].split()[0]
    assert config_path == "/etc/tiercache/%i.toml"

    raw = tomllib.loads((UNITS / f"{INSTANCE}.toml").read_text())
    assert raw["instance"]["name"] == INSTANCE  # the instance the file is named for
    runtime = "/run/" + service["RuntimeDirectory"].replace("%i", INSTANCE)
    assert Path(raw["control"]["socket"]).parent == Path(runtime)
    assert int(service["RuntimeDirectoryMode"], 8) & 0o077 == 0  # the socket's rules
    assert raw["disk"]["path"] == "/var/cache/" + service["CacheDirectory"]
    raw["disk"]["path"] = str(tmp_path)  # the one path that must exist to build a Config
    config = config_from_dict(raw)
    assert config.socket_path == raw["control"]["socket"]


def test_engines_run_as_the_coordinator_and_after_it_but_never_stop_with_it():
    coordinator, engine = _unit("tiercache@.service"), _unit("vllm@.service")
    assert engine["Service"]["User"] == coordinator["Service"]["User"]  # 0600 region/socket
    me = f"tiercache@{INSTANCE}.service"
    assert me in engine["Unit"]["After"].split() and me in engine["Unit"]["Wants"].split()
    for binding in ("Requires", "BindsTo", "PartOf", "Requisite"):
        assert me not in engine["Unit"].get(binding, "").split(), binding
    assert engine["Service"]["LimitMEMLOCK"] == "infinity"  # workers pin their slice
