"""tiercache inside SGLang 0.5.23: ``TierCacheHiCacheStorage``, a HiCache storage backend (L3)
loaded by SGLang's ``dynamic`` backend factory (``"module_path": "tiercache.sglang",
"class_name": "TierCacheHiCacheStorage", "interface_v1": 1``; the README's "Use with SGLang"
and docs/sglang.md).

This package is the only part of tiercache that imports sglang, and only ``storage`` and
``pool_pages`` do (and torch); ``namespace``, ``geometry``, ``settings``, ``counters`` and
the two links are plain Python, so ``tiercache config-for-sglang`` runs on hosts without
SGLang. The backend class resolves lazily.
"""

from __future__ import annotations

import importlib

_EXPORTS = {"TierCacheHiCacheStorage": "tiercache.sglang.storage"}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'tiercache.sglang' has no attribute {name!r}")
