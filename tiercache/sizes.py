"""Byte sizes as people write and read them: ``"8GiB"`` in a config, ``8.00 GiB`` in a message."""

from __future__ import annotations

import re

from tiercache.errors import ConfigError

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, key: str = "size") -> int:
    """``"8GiB"``, ``"512 MiB"``, ``"1.5GB"`` or a plain int -> bytes; ``key`` names the
    config key in the error."""
    if isinstance(value, bool):
        raise ConfigError(f"{key} = {value!r}: expected a byte count or a size like '8GiB'")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{key} = {value}: must be >= 0")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        if m and m.group(2).lower() in _SIZE_UNITS:
            return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])
    raise ConfigError(
        f"{key} = {value!r}: expected a byte count or a size such as '256MiB', '8GiB', '1.5GB' "
        f"(units: {', '.join(u for u in _SIZE_UNITS if u)})"
    )


def format_bytes(num_bytes: int | float) -> str:
    """Human form with binary units, for messages and status output."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    return f"{value:.2f} TiB"


def size_text(num_bytes: int) -> str | int:
    """How a config file writes a size: ``"256GiB"`` where a binary unit divides it exactly
    (``parse_size`` reads it back to the same bytes), the plain byte count otherwise."""
    for unit, factor in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if num_bytes >= factor and num_bytes % factor == 0:
            return f"{num_bytes // factor}{unit}"
    return num_bytes


__all__ = ["format_bytes", "parse_size", "size_text"]
