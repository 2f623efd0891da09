"""Finding tiercache's objects in /dev/shm and removing stale ones (``tiercache status`` /
``clean``): regions (``tiercache-<name>``) and the key presence maps beside them
(``tiercache_keys-<name>``).

``/dev/shm`` is world-writable, so a name proves nothing: an object is removed only if it
is provably ours and provably stale, and anything else is listed with the reason and left
alone. Provably ours: a regular file of our uid with mode 0600 that starts with the
object's own magic (a region's header, perhaps cut short; a map's header). Provably
stale: nobody holds its owner lock (a coordinator holds ``LOCK_EX`` on its region and its
map for life, and the kernel drops it when the process dies), and, for a region, the
coordinator its header names is not running. A file of ours under a region's name without
a region header (another program's file, a tier's data file put in ``/dev/shm``, a region
whose creator was killed before it wrote one) is reported, never removed: ``serve`` of
that name replaces it (it holds the lock then), or the user removes it by hand.

The listing probes the lock with a shared lock, so a probe is never taken for an owner;
removal takes the exclusive lock, re-checks, and unlinks only if the name still refers to
the checked inode (``tiercache.region.shm.unlink_if_same``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from tiercache.errors import RegionError, RegionNotFoundError, RegionTrustError
from tiercache.region.header import HeaderInfo
from tiercache.region.hostmem import process_alive
from tiercache.region.presence import (
    PREFIX as MAP_PREFIX, WHAT as MAP_WHAT, has_map_magic, remove_stale_presence,
)
from tiercache.region.shm import (
    NAME_PREFIX, SHM_DIR, OpenEntry, check_trusted, describe, describe_name, has_region_magic,
    open_entry, other_format_version, owner_lock_held, read_header, recorded_owner, shm_path,
    still_named, take_owner_lock, truncation, unlink_if_same,
)

YOUNG_S = 10.0  # a header-less region younger than this may be mid-creation
NO_HEADER = ("no region header: not provably a tiercache region (a killed coordinator's "
             "unfinished region, which `tiercache serve` of that name replaces, or another "
             "program's file)")


@dataclass(frozen=True)
class RegionListing:
    name: str  # the instance name
    path: str
    size_bytes: int
    live: bool  # its coordinator holds the owner lock
    info: HeaderInfo | None  # None: no valid header (yet)
    found: str  # what the name holds: "a regular file owned by ... with mode 0600"
    problem: str | None = None  # why tiercache may not use it (one line), None if it may
    truncated: str | None = None  # "truncated: N bytes, header says M" (shm.truncation)
    recognised: bool = True  # it starts with a region header's magic (perhaps cut short)
    owner_running: int = 0  # pid of the coordinator its header names, if that one runs

    @property
    def shm_name(self) -> str:
        return NAME_PREFIX + self.name

    @property
    def unrecognised(self) -> str | None:
        """Why ``clean`` leaves this ours, unlocked file alone (None if it does not): no
        region header, or a header naming a coordinator that still runs."""
        if self.live or self.problem:
            return None
        if not self.recognised:
            return NO_HEADER
        if self.owner_running:
            return (f"its lock is free but the coordinator its header names (pid "
                    f"{self.owner_running}) still runs: not provably stale")
        return None

    @property
    def stale(self) -> bool:
        """Provably ours and provably stale: what ``clean`` removes."""
        return not self.live and not self.problem and self.unrecognised is None


@dataclass(frozen=True)
class MapListing:
    """A key presence map (``tiercache.region.presence``) found in /dev/shm."""

    name: str  # the instance name
    path: str
    live: bool  # a coordinator holds its lock
    found: str
    problem: str | None = None  # why tiercache may not use it (one line), None if it may
    recognised: bool = True  # it starts with the map's magic

    @property
    def stale(self) -> bool:
        return not self.live and not self.problem and self.recognised


def _entries(prefix: str, names: Collection[str] | None) -> list[str]:
    return [entry for entry in sorted(os.listdir(SHM_DIR)) if entry.startswith(prefix)
            and (names is None or entry[len(prefix):] in names)]


def list_regions(names: Collection[str] | None = None) -> list[RegionListing]:
    """Every entry of /dev/shm named like a tiercache region (or only those of ``names``)."""
    found = [_probe(entry) for entry in _entries(NAME_PREFIX, names)]
    return [listing for listing in found if listing is not None]


def _probe(shm_name: str) -> RegionListing | None:
    name, path = shm_name[len(NAME_PREFIX):], shm_path(shm_name)
    try:
        entry = open_entry(shm_name, writable=False)
    except RegionNotFoundError:
        return None  # removed since listdir
    except RegionTrustError as e:
        return RegionListing(name, path, 0, False, None, describe_name(path), str(e))
    try:
        problem = None
        try:
            check_trusted(entry)
        except RegionTrustError as e:
            problem = str(e)
        info = read_header(entry.fd)
        owner = recorded_owner(entry.fd)
        running = owner[0] if owner is not None and process_alive(*owner) else 0
        return RegionListing(name, path, entry.st.st_size, owner_lock_held(entry.fd), info,
                             describe(entry.st), problem, truncation(entry.fd, info),
                             has_region_magic(entry.fd), running)
    finally:
        entry.close()


def list_maps(names: Collection[str] | None = None) -> list[MapListing]:
    """Every entry of /dev/shm named like a key presence map (or only those of ``names``)."""
    found = [_probe_map(entry) for entry in _entries(MAP_PREFIX, names)]
    return [listing for listing in found if listing is not None]


def _probe_map(shm_name: str) -> MapListing | None:
    name, path = shm_name[len(MAP_PREFIX):], shm_path(shm_name)
    try:
        entry = open_entry(shm_name, writable=False, what=MAP_WHAT)
    except RegionNotFoundError:
        return None
    except RegionTrustError as e:
        return MapListing(name, path, False, describe_name(path), str(e))
    try:
        problem = None
        try:
            check_trusted(entry, MAP_WHAT)
        except RegionTrustError as e:
            problem = str(e)
        return MapListing(name, path, owner_lock_held(entry.fd), describe(entry.st), problem,
                          has_map_magic(entry.fd))
    finally:
        entry.close()


def may_be_mid_creation(entry: OpenEntry) -> bool:
    """No header yet, young, and not cut short: its coordinator may be setting it up (a
    whole header of another format version is no header *yet*)."""
    return (read_header(entry.fd) is None and other_format_version(entry.fd) is None
            and truncation(entry.fd, None) is None
            and time.time() - entry.st.st_mtime < YOUNG_S)


def remove_stale(dry_run: bool = False, name_prefix: str = "",
                 names: Collection[str] | None = None,
                 before_unlink: Callable[[RegionListing], None] | None = None,
                 ) -> list[RegionListing]:
    """Unlink every stale region of ours (whose name starts with ``name_prefix``, or is
    one of ``names``) and its key presence map; never a live one, never one we may not
    use, never one we cannot prove is a region (see the module docstring).
    ``before_unlink`` runs for each while its lock is held (no coordinator of that name can
    start meanwhile). Returns what was (with ``dry_run``: would be) removed."""
    removed = []
    for listing in list_regions(names):
        if not listing.stale or not listing.name.startswith(name_prefix):
            continue
        if dry_run:
            if before_unlink is not None:
                before_unlink(listing)
            removed.append(listing)
        elif _remove_checked(listing, before_unlink):
            removed.append(listing)
    return removed


def remove_stale_maps(dry_run: bool = False, names: Collection[str] | None = None
                      ) -> list[MapListing]:
    """Unlink every stale key presence map of ours (its coordinator is gone, whether its
    region is still there or not); returns what was (``dry_run``: would be) removed."""
    return [listing for listing in list_maps(names)
            if listing.stale and remove_stale_presence(listing.name, dry_run)]


def _remove_checked(listing: RegionListing,
                    before_unlink: Callable[[RegionListing], None] | None) -> bool:
    """Unlink the region if what its name holds now is ours, stale and a region."""
    try:
        entry = open_entry(listing.shm_name, writable=False)
    except RegionError:
        return False  # gone, or replaced by something we must not touch
    try:
        check_trusted(entry)
        if not take_owner_lock(entry.fd):  # a coordinator took it over meanwhile
            return False
        if not has_region_magic(entry.fd) or not still_named(entry):
            return False
        owner = recorded_owner(entry.fd)
        if owner is not None and process_alive(*owner):
            return False
        if before_unlink is not None:
            before_unlink(listing)
        if not unlink_if_same(entry):
            return False
        remove_stale_presence(listing.name)  # its key presence map, left by a killed coordinator
        return True
    except RegionTrustError:
        return False
    finally:
        entry.close()  # also drops our lock


__all__ = ["MapListing", "RegionListing", "YOUNG_S", "list_maps", "list_regions",
           "may_be_mid_creation", "remove_stale", "remove_stale_maps"]
