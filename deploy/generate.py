"""Write (or check) the coordinator configs in deploy/ from the config command they name.

Each shipped config is what ``tiercache config-for-vllm`` prints for the engine it ships
with (the model, TP, block size and KV dtype in that engine's own manifest), with the node's
flags: nothing in it is edited by hand, so the coordinator and the engine cannot disagree.

    .venv-vllm/bin/python deploy/generate.py            # rewrite them
    .venv-vllm/bin/python deploy/generate.py --check    # exit 1 naming any that differ

Runs where vLLM 0.33 is installed (the command asks vLLM); the models' ``/models/NAME``
paths are read from ``--models`` (default: the published config.json files under
tests/fixtures/models). ``tests/vllm/test_deploy_configs.py`` runs ``--check`` and holds the
commands to the engine manifests' flags.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
MODELS = HERE.parent / "tests" / "fixtures" / "models"

# The Kubernetes node (engine-vllm.yaml: Llama-3.1-8B-Instruct, TP 1) and the systemd node
# (systemd/llama.env: the same model, TP 2).
KUBERNETES = (
    "tiercache config-for-vllm /models/Llama-3.1-8B-Instruct --name node --capacity 64GiB "
    "--socket /run/tiercache/node/tiercache-node.sock --exporter-address 0.0.0.0 "
    "--disk-path /var/cache/tiercache --disk-capacity 512GiB "
    "--events-endpoint tcp://*:5557 --events-replay-endpoint tcp://*:5558 "
    "--cluster-master mooncake-master.tiercache.svc.cluster.local:50051 "
    "--cluster-metadata-server http://mooncake-master.tiercache.svc.cluster.local:8080/metadata "
    "--cluster-local-hostname @POD_IP@ --cluster-key-file /etc/tiercache/cluster.key "
    "--cluster-segment-size 16GiB")
SYSTEMD = (
    "tiercache config-for-vllm /models/Llama-3.1-8B-Instruct --name node --capacity 256GiB "
    "--tensor-parallel-size 2 --socket /run/tiercache/node/tiercache-node.sock "
    "--disk-path /var/cache/tiercache --disk-capacity 1TiB")

CONFIGMAP_HEAD = """\
# The coordinator's config (a ConfigMap). Generated, never edited by hand:
#   {command}
# (deploy/generate.py; engine-vllm.yaml's model, TP, block size and KV dtype are the ones
# in the command, tests/vllm/test_deploy_configs.py checks both). `@POD_IP@` is filled in by
# the DaemonSet's render-config init container (the cluster tier's local_hostname: the
# address other nodes reach this one at); the cluster key (Secret tiercache-cluster-key)
# is installed 0600 for the service uid by its prepare init container.
apiVersion: v1
kind: ConfigMap
metadata:
  name: tiercache-config
  namespace: tiercache
  labels:
    app.kubernetes.io/name: tiercache
data:
  node.toml: |
"""
NODE_TOML_HEAD = """\
# /etc/tiercache/node.toml: the coordinator of tiercache@node.service. Generated, never
# edited by hand (docs/deploy.md, step 3; deploy/generate.py):
#   {command}
# for the engines of llama.env (vllm@llama.service): the same model and TP. The socket is
# in the unit's RuntimeDirectory, the disk tier in its CacheDirectory.
"""


@dataclass(frozen=True)
class Target:
    path: Path
    command: str

    def render(self, models: Path) -> str:
        printed = config_for_vllm(self.command, models)
        if self.path.suffix == ".yaml":
            body = "".join(f"    {line}\n" if line else "\n" for line in printed.splitlines())
            return CONFIGMAP_HEAD.format(command=self.command) + body
        return NODE_TOML_HEAD.format(command=self.command) + printed


TARGETS = (Target(HERE / "kubernetes" / "coordinator-config.yaml", KUBERNETES),
           Target(HERE / "systemd" / "node.toml", SYSTEMD))


def config_for_vllm(command: str, models: Path) -> str:
    """What the command prints, its ``/models/NAME`` read from ``models``."""
    from tiercache.cli import main

    argv = shlex.split(command)
    assert argv[:2] == ["tiercache", "config-for-vllm"], command
    argv = [models / a.removeprefix("/models/") if a.startswith("/models/") else a
            for a in argv[1:]]
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = main([str(a) for a in argv])
    if status != 0:
        raise SystemExit(f"{command}: {err.getvalue().strip()}")
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 on a diff")
    parser.add_argument("--models", type=Path, default=MODELS,
                        help="where /models/NAME is (default: %(default)s)")
    args = parser.parse_args(argv)
    stale = []
    for target in TARGETS:
        text = target.render(args.models)
        if target.path.read_text() == text:
            continue
        stale.append(target.path)
        if not args.check:
            target.path.write_text(text)
    verb = "differs from" if args.check else "rewritten from"
    for path in stale:
        print(f"{path}: {verb} its command", file=sys.stderr)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
