"""The shipped configs (configs/*.toml) load, and their comments say what is true: the
control socket's default path is the one ``Config.socket_path`` computes, and the commands
they quote paste into a shell (no brace lists, no system python without tiercache)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tiercache.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_loads_and_its_commands_paste(path):
    load_config(path)
    commands = [line.lstrip("# ").strip() for line in path.read_text().splitlines()
                if re.match(r"#\s+(make|tiercache|\.venv/bin/tiercache) ", line)]
    for command in commands:
        assert not re.search(r"\{[\w.-]+(?:,[\w.-]+)+\}", command), command
        for quoted in re.findall(r"\bconfigs/[\w.-]+\.toml\b", command):
            assert (path.parent.parent / quoted).is_file(), command
    assert "python3 -m tiercache" not in path.read_text()


def test_the_default_configs_socket_comments_name_the_real_paths(monkeypatch):
    path = next(p for p in CONFIGS if p.name == "default.toml")
    text = path.read_text()
    config = load_config(path)
    monkeypatch.setenv("XDG_RUNTIME_DIR", "/run/user/XDG")
    with_xdg = config.socket_path.replace("/run/user/XDG", "$XDG_RUNTIME_DIR")
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    without = config.socket_path.replace(f"-{os.geteuid()}/", "-<uid>/")
    assert with_xdg == "$XDG_RUNTIME_DIR/tiercache-default.sock"
    assert without == "/tmp/tiercache-<uid>/tiercache-default.sock"
    assert with_xdg in text and without in text
    generic = [p.replace("default", "<name>") for p in (with_xdg, without)]
    socket_line = next(line for line in text.splitlines() if line.startswith("socket ="))
    assert all(p in socket_line for p in generic), socket_line
