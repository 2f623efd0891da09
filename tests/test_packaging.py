"""The coordinator installs and runs without torch (pyproject.toml: torch is the engine's,
an extra): ``tiercache serve``, ``status`` and ``clean`` run in interpreters where ``import
torch`` fails, and neither they nor the ``config-for-*`` commands even try it; engine-side
code entered without torch fails with one line naming what to install."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tiercache.link.client import Client
from tiercache.service.process import CoordinatorProcess

from e2e_support import metrics_url, sample, scrape

REPO = Path(__file__).resolve().parents[1]
PYPROJECT = REPO / "pyproject.toml"
TORCH = "torch>=2.4"
TIMEOUT_S = 60
LLAMA = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "hidden_size": 4096, "torch_dtype": "bfloat16"}
# Put first on sys.path (PYTHONPATH), so every interpreter of the run, children included,
# has no torch: each attempt to import it is written to $NO_TORCH_LOG and fails as it does
# where torch is not installed.
SITECUSTOMIZE = '''
import os, sys, traceback

class NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in ("torch", "torchgen", "functorch"):
            return None
        with open(os.environ["NO_TORCH_LOG"], "a") as log:
            log.write(f"{name} imported by\\n{''.join(traceback.format_stack(limit=8))}\\n")
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

sys.meta_path.insert(0, NoTorch())
'''


class NoTorch:
    """An environment for child interpreters without torch, and what they tried."""

    def __init__(self, root: Path):
        root.mkdir()
        (root / "sitecustomize.py").write_text(SITECUSTOMIZE)
        self.root = root
        self.log = root / "attempts.log"

    def attempts(self) -> str:
        return self.log.read_text() if self.log.exists() else ""

    def run(self, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], capture_output=True, text=True,
                              timeout=TIMEOUT_S, cwd=self.root)


@pytest.fixture
def no_torch(tmp_path, monkeypatch):
    env = NoTorch(tmp_path / "no-torch")
    monkeypatch.setenv("PYTHONPATH", str(env.root))
    monkeypatch.setenv("NO_TORCH_LOG", str(env.log))
    return env


def test_torch_is_an_extra_not_a_dependency():
    project = tomllib.loads(PYPROJECT.read_text())["project"]
    assert not [d for d in project["dependencies"] if d.startswith("torch")]
    extras = project["optional-dependencies"]
    assert extras["engine"] == [TORCH]
    for extra in ("gpu", "vllm", "sglang", "test"):  # each runs engine-side code
        assert TORCH in extras[extra], extra


def test_the_blocker_blocks(no_torch):
    run = no_torch.run("-c", "import torch")
    assert run.returncode == 1 and "No module named 'torch'" in run.stderr
    assert "torch imported by" in no_torch.attempts()


def test_serve_status_and_clean_run_without_torch(no_torch, make_config, tmp_path):
    config = make_config(world_size=1)
    with CoordinatorProcess(config, tmp_path / "coordinator") as coordinator:
        with Client(config) as client:
            assert client.stats().capacity_blocks == 16
        assert sample(scrape(metrics_url(coordinator)), "tiercache_index_capacity_blocks") == 16
        config_path = str(coordinator.config_path)
        status = no_torch.run("-m", "tiercache", "status", "--config", config_path)
        assert status.returncode == 0 and config.name in status.stdout, status.stderr
        clean = no_torch.run("-m", "tiercache", "clean", "--config", config_path, "--dry-run")
        assert clean.returncode == 0, clean.stderr
        assert coordinator.stop() == 0, coordinator.output()
    assert no_torch.attempts() == ""


@pytest.mark.parametrize("command, layout", [
    ("config-for-vllm", ["--tensor-parallel-size", "2"]),
    ("config-for-sglang", ["--tp-size", "2"]),
])
def test_config_commands_never_import_torch(no_torch, tmp_path, command, layout):
    """Without torch (and here without the engine): a config, or one line saying what the
    command needs; never an attempt at torch."""
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    run = no_torch.run("-m", "tiercache", command, str(tmp_path), "--name", "node",
                       "--capacity", "1GiB", *layout)
    if run.returncode == 0:
        assert tomllib.loads(run.stdout)["instance"]["name"] == "node"
    else:
        assert run.returncode == 1 and len(run.stderr.splitlines()) == 1, run.stderr
        assert run.stderr.startswith("tiercache: error: "), run.stderr
    assert no_torch.attempts() == ""


@pytest.mark.parametrize("code", ["import tiercache; tiercache.attach",
                                  "from tiercache.transfer.worker import attach"])
def test_attach_without_torch_is_one_line_naming_the_extra(no_torch, code):
    run = no_torch.run("-c", code)
    assert run.returncode == 1
    assert run.stderr.splitlines()[-1] == (
        "tiercache.errors.EngineDependencyError: tiercache.attach needs torch (the engine's "
        "own; pip install 'tiercache[engine]')")


def test_the_demo_without_torch_is_one_line(no_torch):
    run = no_torch.run("-m", "tiercache", "demo", "--config",
                       str(REPO / "configs" / "default.toml"))
    assert (run.returncode, run.stdout) == (1, "")
    assert run.stderr == ("tiercache: error: tiercache demo needs torch (the engine's own; "
                          "pip install 'tiercache[engine]')\n")
