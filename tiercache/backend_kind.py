"""The one vocabulary for copy backends: config name, stats code and label in one enum.

The config's ``transfer.backend``, the stats block's per-direction backend word, the
``backend`` label of ``tiercache_transfer_backend_info``, ``tiercache status``, the
worker's log line and ``tiercache bench`` all speak ``BackendKind``. The value is the
code the stats block stores (a uint64 word per direction); codes never change meaning,
so a region written by an older worker reads the same. The label is the name in lower
case, and for every kind but ``NONE`` it is also the config name.

Leaf module: no numpy, no torch, nothing from the rest of the package but errors, so
that config parsing and the stats block can import it cheaply.
"""

from __future__ import annotations

from enum import IntEnum

from tiercache.errors import ConfigError


class BackendKind(IntEnum):
    """A copy backend. ``AUTO`` is only ever configured: it resolves to the kind it picks
    per direction, which is what the stats block records. ``NONE`` is only ever recorded:
    no handler of this direction is attached. Members are listed in config order (the
    default first); their values are the stats codes."""

    AUTO = 6  # configured only; never written to a stats block
    CE = 1  # copy engines, cuMemcpyBatchAsync
    KERNEL = 2  # one Triton kernel over UVA (holds SMs)
    STAGED = 3  # GPU-local pack into a staging ring + whole-row DMAs
    CPU = 4  # host memory on both sides, memmove on a host stream
    CE_LOOP = 5  # one cuMemcpyAsync per descriptor: 'ce' on a driver without the batch API
    NONE = 0  # recorded only
    UNKNOWN = 255  # read only: a code this version does not know (a newer worker wrote it)

    @classmethod
    def _missing_(cls, value: object) -> BackendKind | None:
        if isinstance(value, int) and not isinstance(value, bool):
            return cls.UNKNOWN  # a stats block another version wrote is read, no traceback
        return None

    @property
    def label(self) -> str:
        """Config name, metrics label and what ``status`` prints."""
        return self.name.lower()

    @property
    def configurable(self) -> bool:
        return self not in (BackendKind.NONE, BackendKind.UNKNOWN)

    @classmethod
    def parse(cls, name: object, key: str = "transfer.backend") -> BackendKind:
        """The kind whose config name is ``name`` (a configurable ``BackendKind`` passes
        through); ``ConfigError`` naming ``key``, the value and the allowed names otherwise."""
        for kind in cls:
            if kind.configurable and (name is kind or name == kind.label):
                return kind
        allowed = ", ".join(repr(kind.label) for kind in cls if kind.configurable)
        raise ConfigError(f"{key} = {name!r}: allowed {allowed}")
