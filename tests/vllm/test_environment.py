"""The vLLM test environment (``make venv-vllm``) is what the integration tests rely on.

These run only under ``.venv-vllm`` (elsewhere the module is skipped): vLLM 0.33.0 exactly,
beside the CPU torch 2.13.0, with the scheduler and the offloading connector importable.
"""

from __future__ import annotations

import subprocess
import sys

from vllm_env import VLLM_VERSION, require_vllm

require_vllm()

import vllm  # noqa: E402


def test_vllm_is_the_pinned_release_beside_the_cpu_torch():
    import torch

    assert vllm.__version__ == VLLM_VERSION
    assert torch.__version__.split("+")[0] == "2.13.0"
    assert not torch.cuda.is_available()


def test_the_offloading_connector_and_scheduler_import():
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import (
        OffloadingConnector,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_offload.base import OffloadingSpec

    assert OffloadingConnector.get_required_kvcache_layout.__qualname__
    assert Scheduler.schedule
    assert OffloadingSpec.get_manager.__isabstractmethod__


# Packages only a GPU host has (tiercache's [gpu] extra); modules needing them are skipped.
GPU_ONLY_MODULES = ("triton", "cuda", "cuda.bindings")


def test_the_core_never_imports_vllm():
    """Every tiercache module outside the engine adapters (tiercache.vllm, and
    tiercache.sglang, which imports SGLang) loads without pulling vllm in."""
    probe = (
        "import importlib, pkgutil, sys, tiercache\n"
        "ADAPTERS = (['tiercache', 'vllm'], ['tiercache', 'sglang'])\n"
        "for m in pkgutil.walk_packages(tiercache.__path__, 'tiercache.'):\n"
        "    if m.name.endswith('__main__') or m.name.split('.')[:2] in ADAPTERS:\n"
        "        continue\n"
        "    try:\n"
        "        importlib.import_module(m.name)\n"
        "    except ModuleNotFoundError as e:\n"
        "        if e.name not in GPU_ONLY:\n"
        "            raise\n"
        "print(sorted(n for n in sys.modules if n == 'vllm' or n.startswith('vllm.')))\n"
    )
    probe = f"GPU_ONLY = {GPU_ONLY_MODULES!r}\n" + probe
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "[]", out.stdout
