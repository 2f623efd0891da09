"""Taking over a region's name from a coordinator that is gone (``create``'s first step).

The coordinator holds an exclusive ``flock`` on its region for its whole life, so a
region whose lock is free is stale. A probe (``tiercache status``, ``clean``) takes the
same lock for microseconds, so a lock that is held while the recorded coordinator is
dead is retried for ``CLAIM_RETRY_S`` before it counts as another process's. A region
without a header yet may be mid-creation by a coordinator starting at this moment
(``tiercache.region.stale.may_be_mid_creation``): refused, never taken over. Only our own
0600 regular file is ever claimed (``tiercache.region.shm.check_trusted``).
"""

from __future__ import annotations

import time
from contextlib import ExitStack

from tiercache.errors import RegionExistsError, RegionNotFoundError
from tiercache.region.hostmem import process_alive
from tiercache.region.shm import (
    OpenEntry, check_trusted, open_entry, owner_lock_held, read_header, still_named,
    take_owner_lock,
)
from tiercache.region.stale import YOUNG_S, may_be_mid_creation

POLL_S = 0.005
# How long ``create`` keeps trying the owner lock of a region whose recorded coordinator is
# dead: a probe of `status`/`clean` holds it for microseconds, `clean` for milliseconds.
CLAIM_RETRY_S = 2.0


def claim_stale(shm_name: str) -> OpenEntry | None:
    """The existing region of ``shm_name`` with its owner lock taken, or None if there is
    none. Refuses (``RegionExistsError``) a live one or one mid-creation, and
    (``RegionTrustError``) anything that is not ours. A lock that is held while the
    recorded coordinator is dead is retried for ``CLAIM_RETRY_S``: a probe holds it
    for microseconds and must not be taken for an owner."""
    deadline = time.monotonic() + CLAIM_RETRY_S
    while True:
        try:
            entry = open_entry(shm_name, writable=True)
        except RegionNotFoundError:
            return None
        with ExitStack() as release:
            release.callback(entry.close)
            check_trusted(entry)
            if take_owner_lock(entry.fd):
                if not still_named(entry):
                    continue  # removed or replaced since we opened it: look again
                if may_be_mid_creation(entry):
                    raise RegionExistsError(
                        f"{entry.path} is being created by another coordinator (no header "
                        f"yet); retry in {YOUNG_S:.0f} s or choose another instance.name")
                release.pop_all()
                return entry
            info = read_header(entry.fd)
            if info is not None and process_alive(info.owner_pid, info.owner_start_ns):
                raise RegionExistsError(_live_owner(entry, info.owner_pid))
            if time.monotonic() >= deadline:
                owner = f"pid {info.owner_pid}" if info else "unknown"
                raise RegionExistsError(
                    f"{entry.path} stayed locked for {CLAIM_RETRY_S:.0f} s although its "
                    f"recorded coordinator ({owner}) is gone: another process holds it (one "
                    "that inherited the coordinator's descriptor, or a `tiercache clean` that "
                    "hangs); stop it first, or choose another instance.name")
        time.sleep(POLL_S)


def check_claimable(shm_name: str, what: str = "region") -> None:
    """What ``claim_stale`` refuses at once, found without taking the name or its lock:
    anything under ``shm_name`` that is not ours (``RegionTrustError``; ``what`` names the
    kind of object: the key presence map beside a region is checked too) and a region
    whose recorded coordinator is alive and holds its lock (``RegionExistsError``). A
    stale object of ours passes: the start re-adopts or replaces it. The coordinator's
    start runs this before it allocates anything; ``claim_stale`` still decides."""
    try:
        entry = open_entry(shm_name, writable=True, what=what)
    except RegionNotFoundError:
        return
    try:
        check_trusted(entry, what)
        if not owner_lock_held(entry.fd):
            return
        info = read_header(entry.fd) if what == "region" else None
        if info is not None and process_alive(info.owner_pid, info.owner_start_ns):
            raise RegionExistsError(_live_owner(entry, info.owner_pid))
    finally:
        entry.close()


def _live_owner(entry: OpenEntry, pid: int) -> str:
    return (f"{entry.path} belongs to a live coordinator (pid {pid}); stop it first, or "
            "choose another instance.name")
