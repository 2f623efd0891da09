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
    "SharedOffloadRegion": "tiercache.region.shared",
    "GPULoadStoreSpec": "tiercache.specs",
    "CPULoadStoreSpec": "tiercache.specs",
    "SingleDirectionOffloadingHandler": "tiercache.transfer.handlers",
    "CpuGpuOffloadingHandlers": "tiercache.transfer.handlers",
    "TransferResult": "tiercache.transfer.handlers",
    "OffloadingManager": "tiercache.index.manager",
    "PrepareStoreOutput": "tiercache.index.manager",
    "OffloadingEvent": "tiercache.index.manager",
    "Client": "tiercache.control.client",
    "attach": "tiercache.transfer.worker",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tiercache' has no attribute {name!r}")
