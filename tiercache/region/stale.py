"""Finding regions in /dev/shm and removing stale ones (``tiercache status`` / ``clean``).

A region is live while its coordinator holds the owner lock (``tiercache.region.shm``);
the listing probes it with a shared lock, so a probe is never taken for an owner. What is
removed is only what was checked: a stale region that is ours (a regular file, our uid,
mode 0600), unlinked while its lock is held and only if the name still refers to it.
Anything else under a region's name (a FIFO, a directory, another user's file) is listed
with the reason and left alone.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from tiercache.errors import RegionError, RegionNotFoundError, RegionTrustError
from tiercache.region.header import HeaderInfo
from tiercache.region.presence import remove_stale_presence
from tiercache.region.shm import (
    NAME_PREFIX, SHM_DIR, OpenEntry, check_trusted, describe, describe_name, open_entry,
    owner_lock_held, read_header, shm_path, still_named, take_owner_lock, truncation,
    unlink_if_same,
)

YOUNG_S = 10.0  # a header-less region younger than this may be mid-creation: left alone


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

    @property
    def shm_name(self) -> str:
        return NAME_PREFIX + self.name


def list_regions(names: Collection[str] | None = None) -> list[RegionListing]:
    """Every entry of /dev/shm named like a tiercache region (or only those of ``names``)."""
    found = []
    for entry in sorted(os.listdir(SHM_DIR)):
        if not entry.startswith(NAME_PREFIX):
            continue
        if names is not None and entry[len(NAME_PREFIX):] not in names:
            continue
        listing = _probe(entry)
        if listing is not None:
            found.append(listing)
    return found


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
        return RegionListing(name, path, entry.st.st_size, owner_lock_held(entry.fd), info,
                             describe(entry.st), problem, truncation(entry.fd, info))
    finally:
        entry.close()


def may_be_mid_creation(entry: OpenEntry) -> bool:
    """No header yet, young, and not cut short: its coordinator may be setting it up."""
    return (read_header(entry.fd) is None and truncation(entry.fd, None) is None
            and time.time() - entry.st.st_mtime < YOUNG_S)


def remove_stale(dry_run: bool = False, name_prefix: str = "",
                 names: Collection[str] | None = None,
                 before_unlink: Callable[[RegionListing], None] | None = None,
                 ) -> list[RegionListing]:
    """Unlink every stale region of ours (whose name starts with ``name_prefix``, or is
    one of ``names``); never a live one, never one we may not use. ``before_unlink`` runs
    for each while its lock is held (no coordinator of that name can start meanwhile).
    Returns what was (with ``dry_run``: would be) removed."""
    removed = []
    for listing in list_regions(names):
        if listing.live or listing.problem or not listing.name.startswith(name_prefix):
            continue
        if dry_run:
            if before_unlink is not None:
                before_unlink(listing)
            removed.append(listing)
        elif _remove_checked(listing, before_unlink):
            removed.append(listing)
    return removed


def _remove_checked(listing: RegionListing,
                    before_unlink: Callable[[RegionListing], None] | None) -> bool:
    """Unlink the region if what its name holds now is ours, stale and not mid-creation."""
    try:
        entry = open_entry(listing.shm_name, writable=False)
    except RegionError:
        return False  # gone, or replaced by something we must not touch
    try:
        check_trusted(entry)
        if not take_owner_lock(entry.fd):  # a coordinator took it over meanwhile
            return False
        if may_be_mid_creation(entry) or not still_named(entry):
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


__all__ = ["RegionListing", "YOUNG_S", "list_regions", "may_be_mid_creation", "remove_stale"]
