"""The import order the tree promises (docs/architecture.md): the coordinator side and
the index never import torch, and no module imports a layer above its own."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tiercache"
# lower index = lower layer; a module may import its own layer or lower ones
LAYERS = ["errors", "specs", "pages", "sizes", "backends", "config", "region", "index",
          "tiers", "transfer", "metrics", "service", "vllm", "tools", "cli"]


def test_the_coordinator_side_never_imports_torch():
    code = ("import sys, tiercache.service.coordinator, tiercache.index.client, "
            "tiercache.metrics.collector, tiercache.cli; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert out == "False"


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def test_no_module_imports_a_higher_layer():
    upward = []
    for path in PACKAGE.rglob("*.py"):
        own = _layer("tiercache." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts))
        if own is None:
            continue
        tree = ast.parse(path.read_text())
        type_only = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                     and ast.unparse(node.test) == "TYPE_CHECKING" for n in ast.walk(node)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and id(node) not in type_only:
                other = _layer(node.module)
                if other is not None and LAYERS.index(other) > LAYERS.index(own):
                    upward.append(f"{path.relative_to(PACKAGE)} imports {node.module}")
    assert not upward, upward
