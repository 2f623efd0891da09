"""A region found by its instance name: its shm name, and what its header says now.

Readers that only look (a worker deciding whether its coordinator replaced the region,
a client finding the control socket the coordinator recorded) open the name read-only,
non-blocking, links not followed and the type checked (``tiercache.region.shm``), read
the header and close it: nothing is mapped and nothing is locked.
"""

from __future__ import annotations

from tiercache.errors import RegionError
from tiercache.region.header import HeaderInfo, RegionState
from tiercache.region.shm import NAME_PREFIX, open_entry, read_header


def region_shm_name(name: str) -> str:
    """``tiercache-<name>`` for an instance name (a full shm name is kept as it is)."""
    return name if name.startswith(NAME_PREFIX) else NAME_PREFIX + name


def named_region_info(name: str) -> HeaderInfo | None:
    """The header of the READY region now under instance ``name``, or None (no region, not
    a usable file, not READY). The open is ``open_entry``'s: non-blocking, links not
    followed, type checked."""
    shm_name = region_shm_name(name)
    try:
        entry = open_entry(shm_name, writable=False)
    except RegionError:
        return None
    try:
        info = read_header(entry.fd)
    finally:
        entry.close()
    if info is None or info.state != RegionState.READY:
        return None
    return info


def recorded_socket_path(name: str) -> str | None:
    """The control socket path the coordinator of instance ``name`` recorded in its region
    header, or None (no READY region, or nothing recorded)."""
    info = named_region_info(name)
    return info.socket_path or None if info is not None else None
