"""tiercache: a node-local tiered KV-cache service for GPU LLM inference.

The public API (the names in ``_EXPORTS``; README.md's "Using it from an engine" shows it
in use, docs/architecture.md where each lives) is re-exported here. Names resolve lazily, so
``import tiercache`` stays light (no torch) for the coordinator and the scheduler.
``__version__`` is the installed distribution's (pyproject.toml's ``version``, the one
place it is written), read when first asked for.
"""

from __future__ import annotations

import importlib

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
    "PrepareStoreOutput": "tiercache.results",
    "OffloadingEvent": "tiercache.results",
    "Client": "tiercache.link.client",
    "attach": "tiercache.transfer.worker",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("tiercache")
    except PackageNotFoundError:  # a source tree on sys.path that was never installed
        return "0+unknown"


def __getattr__(name: str):
    if name == "__version__":
        return _version()
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tiercache' has no attribute {name!r}")
