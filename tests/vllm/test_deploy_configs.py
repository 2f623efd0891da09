"""Shipped equals tested: the coordinator configs in deploy/ are what `tiercache
config-for-vllm` prints for the engines shipped beside them (their own manifests' model, TP,
block size, KV dtype and blocks per chunk), and docs/deploy.md's systemd steps run as
written. (Before this test the ConfigMap gave 64 pages of 32 KiB where the engine announces
32 of 64 KiB: it failed here.)"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

from vllm_env import require_vllm

require_vllm()

import yaml  # noqa: E402

from tiercache.vllm.config_cmd import build_parser  # noqa: E402
from test_model_matrix import MODELS, torchvision_stub  # noqa: E402, F401

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "deploy.md"


def _generate():
    spec = importlib.util.spec_from_file_location("deploy_generate",
                                                  REPO / "deploy" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks itself up there
    spec.loader.exec_module(module)
    return module


generate = _generate()


def test_the_shipped_configs_are_what_their_commands_print(capsys):
    assert generate.main(["--check"]) == 0, capsys.readouterr().err


def test_the_check_fails_on_a_config_edited_by_hand(tmp_path, monkeypatch, capsys):
    target = generate.TARGETS[0]
    edited = tmp_path / target.path.name
    edited.write_text(target.path.read_text().replace("65536", "32768", 1))
    monkeypatch.setattr(generate, "TARGETS", (generate.Target(edited, target.command),))
    assert generate.main(["--check"]) == 1
    assert "differs from its command" in capsys.readouterr().err


def _command(command: str):
    argv = shlex.split(command)
    return build_parser().parse_args(argv[2:])


def _vllm_flags(argv: list[str], extra: dict) -> dict:
    """The geometry-bearing flags of a `vllm serve` command line, with vLLM's defaults. The
    block size must be given: without it vLLM takes its attention backend's preferred one
    (FlashMLA's is 64), which no config written ahead of the engine can know."""
    assert any(a.partition("=")[0] == "--block-size" for a in argv), argv
    flags = {"--tensor-parallel-size": "1", "--block-size": "16", "--kv-cache-dtype": "auto",
             "--pipeline-parallel-size": "1"}
    aliases = {"-tp": "--tensor-parallel-size", "-pp": "--pipeline-parallel-size"}
    for i, arg in enumerate(argv):
        name, _, value = arg.partition("=")
        name = aliases.get(name, name)
        if name in flags:
            flags[name] = value or argv[i + 1]
    return {"tp": int(flags["--tensor-parallel-size"]),
            "pp": int(flags["--pipeline-parallel-size"]),
            "block_size": int(flags["--block-size"]), "kv_dtype": flags["--kv-cache-dtype"],
            "blocks_per_chunk": int(extra.get("blocks_per_chunk", 1))}


def _command_flags(args) -> dict:
    return {"tp": args.tensor_parallel_size, "pp": args.pipeline_parallel_size,
            "block_size": args.block_size, "kv_dtype": args.kv_cache_dtype,
            "blocks_per_chunk": args.blocks_per_chunk}


def test_the_kubernetes_config_is_generated_for_the_engine_it_ships_with():
    docs = yaml.safe_load_all((REPO / "deploy" / "kubernetes" / "engine-vllm.yaml").read_text())
    engine = next(d for d in docs if d and d["kind"] == "Deployment")
    argv = engine["spec"]["template"]["spec"]["containers"][0]["command"]
    assert argv[:2] == ["vllm", "serve"]
    transfer = json.loads(argv[argv.index("--kv-transfer-config") + 1])
    extra = transfer["kv_connector_extra_config"]
    args = _command(generate.KUBERNETES)
    assert args.model == argv[2]
    assert _command_flags(args) == _vllm_flags(argv, extra)
    assert extra["tiercache_instance"] == args.name


def test_the_systemd_config_is_generated_for_the_engine_env_file_it_ships_with():
    env = dict(line.split("=", 1) for line in
               (REPO / "deploy" / "systemd" / "llama.env").read_text().splitlines()
               if line and not line.startswith("#"))
    extra = json.loads(env["KV_TRANSFER_CONFIG"])["kv_connector_extra_config"]
    args = _command(generate.SYSTEMD)
    assert args.model == env["MODEL"]
    assert _command_flags(args) == _vllm_flags(env["VLLM_ARGS"].split(), extra)
    assert extra["tiercache_config"] == f"/etc/tiercache/{args.name}.toml"  # the unit's %i


def _step(number: int) -> str:
    """The ``sh`` block of the systemd walk-through's step ``number``."""
    text = DOCS.read_text().split("## systemd: a node from nothing to serving")[1]
    step = re.search(rf"^{number}\. \*\*.*?(?=^{number + 1}\. \*\*)", text, re.S | re.M).group(0)
    block = re.search(r"```sh\n(.*?)```", step, re.S).group(1)
    return "\n".join(line.strip() for line in block.splitlines())


def test_step_3_runs_as_written_and_writes_the_shipped_node_toml(tmp_path):
    """The docs' commands in a shell, with the machine's paths moved under a scratch root:
    the engines' tiercache is this venv's, /models/ the published config.json files."""
    script = _step(3)
    assert f"/opt/vllm/bin/{generate.SYSTEMD} > /etc/tiercache/node.toml" in script
    root = tmp_path / "root"
    script = (script.replace("/opt/vllm/bin/tiercache", f"{sys.executable} -m tiercache")
              .replace("/models/", f"{MODELS}/").replace("/etc/", f"{root}/etc/"))
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr
    written = (root / "etc" / "tiercache" / "node.toml").read_text()
    shipped = (REPO / "deploy" / "systemd" / "node.toml").read_text()
    assert shipped == generate.NODE_TOML_HEAD.format(command=generate.SYSTEMD) + written


def test_step_6_shows_the_shipped_engine_env_file():
    env = (REPO / "deploy" / "systemd" / "llama.env").read_text().splitlines()
    assert _step(6).splitlines() == [line for line in env if line and not line.startswith("#")]
