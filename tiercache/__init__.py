"""tiercache: a node-local tiered KV-cache service for GPU LLM inference.

The public API (DESIGN §9) is re-exported here. Names resolve lazily, so
``import tiercache`` stays light (no torch) for the coordinator and the scheduler.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "load_config": "tiercache.config",
    "Config": "tiercache.config",
    "SharedOffloadRegion": "tiercache.region",
    "GPULoadStoreSpec": "tiercache.specs",
    "CPULoadStoreSpec": "tiercache.specs",
    "SingleDirectionOffloadingHandler": "tiercache.handlers",
    "CpuGpuOffloadingHandlers": "tiercache.handlers",
    "TransferResult": "tiercache.handlers",
    "OffloadingManager": "tiercache.manager",
    "PrepareStoreOutput": "tiercache.manager",
    "OffloadingEvent": "tiercache.manager",
    "Client": "tiercache.client",
    "attach": "tiercache.worker",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tiercache' has no attribute {name!r}")
