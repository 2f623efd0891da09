"""The README says what is true: its engine example runs as written (from a directory whose
``configs/default.toml`` is a coordinator's config, against that real ``tiercache serve``),
its commands name make targets, configs and subcommands that exist and paste into a shell,
and its dashboard paragraph names the dashboard's rows, in order."""

import dataclasses
import re
import shlex
import subprocess
import sys
from pathlib import Path

from tiercache.cli import build_parser
from tiercache.config import config_to_toml, load_config
from tiercache.link.client import Client
from tiercache.service.process import CoordinatorProcess

import dashboard_queries as dq

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
NUMBERS = {"four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9, "ten": 10}


def _sh_commands(text: str) -> list[str]:
    """Every command of the README's ``sh`` blocks, continuation lines joined, comments cut."""
    commands = []
    for block in re.findall(r"```sh\n(.*?)```", text, re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                commands.append(line)
    return commands


def _make_targets() -> set[str]:
    makefile = (REPO / "Makefile").read_text()
    return set(re.findall(r"^([\w-]+):", makefile, re.M))


def dashboard_rows() -> list[tuple[str, list[str]]]:
    """The dashboard's rows, in order, each with its panels' titles."""
    rows: list[tuple[str, list[str]]] = []
    for panel in dq.load(dq.DASHBOARD_DIR / "tiercache.json")["panels"]:
        if panel["type"] == "row":
            rows.append((panel["title"], [p["title"] for p in panel.get("panels", [])]))
        else:
            rows[-1][1].append(panel["title"])
    return rows


def test_readme_engine_example_runs_as_written(instance_name, tmp_path):
    section = README.read_text().split("## Using it from an engine", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    default = load_config(REPO / "configs" / "default.toml")
    config = dataclasses.replace(  # the shipped config, under a name and ports of this test
        default, name=instance_name, control_socket=str(tmp_path / "control.sock"),
        exporter=dataclasses.replace(default.exporter, port=0))
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "default.toml").write_text(config_to_toml(config))
    with CoordinatorProcess(config, tmp_path / "coordinator"):
        run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                             text=True)
        assert run.returncode == 0, run.stderr  # its asserts are the checks
        with Client(config) as index:
            assert index.stats().ready_blocks == 2


def test_readme_commands_name_what_exists():
    text = README.read_text()
    targets, subcommands = _make_targets(), set()
    for action in build_parser()._subparsers._group_actions:
        subcommands.update(action.choices)
    commands = _sh_commands(text)
    assert "make serve" in commands and "make test" in commands
    for command in commands:
        if command.split()[0] not in ("make", "tiercache", ".venv/bin/tiercache"):
            continue  # the engines' own commands, curl
        words = shlex.split(command)
        if words[0] == "make":
            for word in words[1:]:
                if "=" not in word:
                    assert word in targets, f"{command!r}: no make target {word!r}"
        if words[0] in ("tiercache", ".venv/bin/tiercache"):
            assert words[1] in subcommands, command
    for path in set(re.findall(r"\bconfigs/[\w.-]+\.toml\b", text)):
        assert (REPO / path).is_file(), path
    # what does not paste: a brace list (one word per item, wrong for --config) and the
    # system python, which has no tiercache (it is in .venv)
    inline = re.findall(r"`((?:make|tiercache|\.venv/bin/\w+) [^`]*)`", text)
    for command in commands + inline:
        assert not re.search(r"\{[\w.-]+(?:,[\w.-]+)+\}", command), command
    assert "python3 -m tiercache" not in text


def test_readme_names_the_dashboards_rows():
    text = " ".join(README.read_text().split())
    found = re.search(r"`dashboards/tiercache\.json` .*? has (\w+) rows: (.*?)\. Every query", text)
    assert found, "the README's dashboard paragraph"
    count, listing = found.groups()
    rows = [title for title, _ in dashboard_rows()]
    assert NUMBERS[count] == len(rows)
    assert re.findall(r"\*([^*]+)\*", listing) == rows
