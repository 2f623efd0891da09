"""The house by process: what each process may load (docs/architecture.md, "By process"),
and what an entry point really loads, read from a fresh interpreter.

A process is allowed whole layers (``house.GROUPS``) and single modules besides; any
other tiercache module it loads is a breach, as is a third-party package on its
forbidden list that tiercache's import added (beyond what the engine's own modules load
first: vLLM itself loads pyzmq, tiercache must not be why). tests/test_loads.py checks
the coordinator (a real ``tiercache serve``), an engine's control client and ``attach``;
tests/vllm/test_vllm_loads.py and tests/sglang/test_sglang_loads.py the engines' processes, each in
the venv its engine is installed in.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from house import GROUPS, layer

REPO = Path(__file__).resolve().parents[2]
FOUNDATION = frozenset(GROUPS["foundation"])
WORKER_WING = frozenset(GROUPS["worker"])
COORDINATOR_WING = frozenset(GROUPS["coordinator"])
LINK = frozenset(GROUPS["link"])  # the engines' side of the control plane and its wire
VLLM_SHARED = frozenset({  # built in both of vLLM's processes
    "tiercache.vllm", "tiercache.vllm.spec", "tiercache.vllm.geometry",
    "tiercache.vllm.namespace", "tiercache.vllm.load_store_spec", "tiercache.vllm.fenced_slot",
    "tiercache.vllm.engine_metrics",
})


@dataclass(frozen=True)
class Process:
    name: str
    layers: frozenset[str]
    modules: frozenset[str] = frozenset()
    forbidden_packages: frozenset[str] = frozenset()

    def allows(self, module: str) -> bool:
        return module == "tiercache" or layer(module) in self.layers or module in self.modules

    def breaches(self, loaded: Loaded) -> list[str]:
        wrong = [f"{self.name} loads {m}" for m in sorted(loaded.tiercache) if not self.allows(m)]
        wrong += [f"{self.name}: tiercache's import loads {p}"
                  for p in sorted(loaded.added & self.forbidden_packages)]
        return wrong


COORDINATOR = Process("the coordinator (tiercache serve)",
                      FOUNDATION | LINK | COORDINATOR_WING | {"cli", "__main__"},
                      forbidden_packages=frozenset({"torch", "triton"}))
ENGINE_CLIENT = Process("an engine's control client", FOUNDATION | LINK,
                        forbidden_packages=frozenset({"zmq", "msgspec", "torch"}))
WORKER = Process("a worker (tiercache.attach)", FOUNDATION | WORKER_WING,
                 forbidden_packages=frozenset({"zmq", "msgspec"}))
VLLM_SCHEDULER = Process(
    "vLLM's scheduler", FOUNDATION | LINK,
    VLLM_SHARED | {
        "tiercache.vllm.manager", "tiercache.vllm.flusher", "tiercache.vllm.leases",
        "tiercache.vllm.batch"},
    forbidden_packages=frozenset({"zmq"}))
VLLM_WORKER = Process("vLLM's worker", FOUNDATION | WORKER_WING,
                      VLLM_SHARED | {"tiercache.vllm.worker"},
                      forbidden_packages=frozenset({"zmq"}))
SGLANG_BACKEND = Process("SGLang's HiCache backend", FOUNDATION | WORKER_WING | LINK | {"sglang"},
                         forbidden_packages=frozenset({"zmq"}))


@dataclass(frozen=True)
class Loaded:
    tiercache: frozenset[str]  # every tiercache module in sys.modules
    added: frozenset[str]  # top-level packages the entry's import added to the baseline's


_CHILD = """
import importlib, json, sys
for name in {baseline!r}:
    importlib.import_module(name)
before = set(sys.modules)
for name in {entry!r}:
    module, _, attr = name.partition(":")
    if attr:
        getattr(importlib.import_module(module), attr)
    else:
        importlib.import_module(module)
print(json.dumps({{
    "tiercache": sorted(m for m in sys.modules if m == "tiercache" or m.startswith("tiercache.")),
    "added": sorted({{m.split(".")[0] for m in set(sys.modules) - before}}),
}}))
"""


def loaded(entry: Sequence[str], baseline: Sequence[str] = (), python: str = sys.executable,
           path: Iterable[str] = ()) -> Loaded:
    """What importing ``entry`` loads in a fresh interpreter, after ``baseline``
    (``"package:name"``: the name taken from the package, as ``from package import name``
    does)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([*path, str(REPO)])
    out = subprocess.run([python, "-c", _CHILD.format(baseline=list(baseline), entry=list(entry))],
                         capture_output=True, text=True, env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr
    found = json.loads(out.stdout.strip().splitlines()[-1])
    return Loaded(frozenset(found["tiercache"]), frozenset(found["added"]))


def imported_names(importtime_log: str) -> frozenset[str]:
    """The modules a ``PYTHONPROFILEIMPORTTIME=1`` interpreter reported importing."""
    names = set()
    for line in importtime_log.splitlines():
        if line.startswith("import time:") and "|" in line:
            name = line.rsplit("|", 1)[1].strip()
            if name != "package":  # the header row
                names.add(name)
    return frozenset(names)


def loaded_from_log(importtime_log: str) -> Loaded:
    names = imported_names(importtime_log)
    return Loaded(frozenset(n for n in names if n == "tiercache" or n.startswith("tiercache.")),
                  frozenset(n.split(".")[0] for n in names))
