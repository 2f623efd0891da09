"""tiercache inside vLLM 0.33: ``TierCacheOffloadingSpec`` for vLLM's ``OffloadingConnector``.

``"spec_name": "TierCacheOffloadingSpec", "spec_module_path": "tiercache.vllm"`` in
``kv_connector_extra_config`` (see ``tiercache.vllm.spec`` and the README's "Use with
vLLM"). This package is the only part of tiercache that imports vllm, and only the
modules that need it do: ``namespace``, ``geometry``, ``leases`` and ``flusher`` are plain
Python (the ``config-for-vllm`` command uses them on hosts without vLLM), while ``spec``,
``manager``, ``worker``, ``load_store_spec`` and ``engine_metrics`` import vllm. vLLM
builds the spec in its scheduler process and in each worker process; each imports its own
side only (``manager`` and the lease book, or ``worker`` and the transfer path), and
``load_store_spec`` is what crosses between them. The spec class resolves lazily, so
importing this package costs nothing until vLLM asks for it.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "TierCacheOffloadingSpec": "tiercache.vllm.spec",
    "TierCacheManager": "tiercache.vllm.manager",
    "TierCacheWorker": "tiercache.vllm.worker",
    "TierCacheLoadStoreSpec": "tiercache.vllm.load_store_spec",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tiercache.vllm' has no attribute {name!r}")
