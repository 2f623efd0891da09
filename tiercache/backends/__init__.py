"""Copy backends: a registry from ``BackendKind`` to a lazily imported factory.

Every backend module exposes ``create(context: BackendContext) -> CopyBackend`` (see
``tiercache.backends.base`` for what a backend guarantees). Modules are imported only
when their kind is chosen, so GPU modules (triton, the CUDA driver) never load on a
CPU host. A chosen backend that cannot run here raises ``BackendError``; nothing falls back
silently. ``AUTO`` picks per direction and returns the chosen backend, whose ``kind``
(CE or STAGED) is what the stats block records. ``CE`` on a driver without the batch API
runs as ``CE_LOOP``, logged at WARNING and recorded as such (visible in ``status`` and
``/metrics``).

What a backend's ``submit(plan, ordering)`` receives as ``ordering.stream``: a stream of
the kind's platform (``STREAM_PLATFORMS``, ``tiercache.device``): a ``torch.cuda.Stream``
on the caches' device for the GPU kinds (raw handle: ``stream.cuda_stream``; never the
legacy default stream), a ``tiercache.device.host_streams.HostStream`` for ``cpu``.
"""

from __future__ import annotations

import importlib
from typing import Any

from tiercache.backends.base import BackendContext, CopyBackend, Ordering, Submission
from tiercache.backend_kind import BackendKind
from tiercache.device.streams import StreamPlatform
from tiercache.errors import BackendError

# The hooks: "module:callable" per kind. GPU kinds live in modules of their own.
BACKEND_FACTORIES: dict[BackendKind, str] = {
    BackendKind.CPU: "tiercache.backends.cpu:create",
    BackendKind.CE: "tiercache.backends.ce:create",
    BackendKind.KERNEL: "tiercache.backends.kernel:create",
    BackendKind.STAGED: "tiercache.backends.staged.backend:create",
    BackendKind.CE_LOOP: "tiercache.backends.ce:create_loop",
    BackendKind.AUTO: "tiercache.backends.auto:create",
}
# "module:callable(device) -> StreamPlatform" per kind.
STREAM_PLATFORMS: dict[BackendKind, str] = {
    BackendKind.CPU: "tiercache.device.host_streams:HostStreams",
    BackendKind.CE: "tiercache.device.streams:CudaStreams",
    BackendKind.KERNEL: "tiercache.device.streams:CudaStreams",
    BackendKind.STAGED: "tiercache.device.streams:CudaStreams",
    BackendKind.CE_LOOP: "tiercache.device.streams:CudaStreams",
    BackendKind.AUTO: "tiercache.device.streams:CudaStreams",
}
HOST_KINDS = frozenset({BackendKind.CPU})  # kinds whose both sides are host memory


def _load(target: str, kind: BackendKind) -> Any:
    module_name, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise BackendError(f"backend {kind.label!r} is not available here: cannot load "
                           f"{target} ({e})") from e


def resolve_kind(kind: BackendKind, device_type: str) -> BackendKind:
    """The kind to build for caches on ``device_type`` ('cpu' or 'cuda').

    ``AUTO`` over CPU tensors is ``CPU`` (the only kind that can move host memory on
    both sides); any other mismatch is refused.
    """
    if kind not in BACKEND_FACTORIES:
        raise BackendError(f"backend {kind.label!r} cannot be built; choose one of "
                           f"{[k.label for k in BACKEND_FACTORIES]}")
    if kind is BackendKind.AUTO and device_type == "cpu":
        return BackendKind.CPU
    if kind in HOST_KINDS and device_type != "cpu":
        raise BackendError(f"backend {kind.label!r} moves host memory only, but the KV caches "
                           f"are on {device_type!r}; choose one of "
                           f"{[k.label for k in BACKEND_FACTORIES if k not in HOST_KINDS]}")
    if kind not in HOST_KINDS and device_type != "cuda":
        raise BackendError(f"backend {kind.label!r} needs the KV caches on a CUDA device, "
                           f"they are on {device_type!r}; use backend 'cpu' (or 'auto')")
    return kind


def create_stream_platform(kind: BackendKind, device: Any) -> StreamPlatform:
    return _load(STREAM_PLATFORMS[kind], kind)(device)


def create_backend(kind: BackendKind, context: BackendContext) -> CopyBackend:
    backend = _load(BACKEND_FACTORIES[kind], kind)(context)
    if not isinstance(backend, CopyBackend):
        raise BackendError(f"{BACKEND_FACTORIES[kind]} returned {type(backend).__name__}, "
                           "not a CopyBackend")
    return backend


__all__ = [
    "BACKEND_FACTORIES", "STREAM_PLATFORMS", "BackendContext", "BackendKind", "CopyBackend",
    "Ordering", "Submission", "create_backend", "create_stream_platform", "resolve_kind",
]
