"""The key presence map: which keys the coordinator may hold, readable by engines with no RPC.

A scheduler must answer a new request's first lookup in the step it is asked: RETRY defers
the request a whole step even when nothing is cached (a cold miss, most new requests). The
coordinator therefore keeps, beside the region, a small shared-memory object
``/dev/shm/tiercache_keys-<instance>`` of one-byte counters that engines map read-only::

    offset 0   magic  b"TCKEYS01"
           8   u32    format version (1)
          12   u32    flags: bit 0 EXACT (a zero counter means "not held")
          16   u64    number of counters (a power of two)
          24   u64    region id of the coordinator that writes it
          64   u8[n]  counters

A key's counter is ``counters[crc32(key) & (n - 1)]``, over the whole wire key (an engine
with a namespace prefix hashes ``crc32(key, crc32(prefix))``, the same value). The
coordinator adds one for every tier that comes to hold a key (host memory when a block
becomes READY, the disk tier when it writes one) and takes one away when it stops (an
eviction, a dropped disk slot); a counter that reaches 255 stays there for good. So:

* a zero counter in an EXACT map means no tier held the key when it was read: a definite
  miss, answered at once;
* anything else means "maybe": the engine asks the coordinator, which answers with a
  lease (a HIT only ever comes from a lease, never from this map).

The map is a hint. A stale read (a block stored a microsecond later, a coordinator that
restarted under a map the engine still has mapped) costs a hit or a step, never a byte:
what an engine loads is decided by its lease. A tier whose keys cannot be counted (one
shared with other nodes) clears EXACT, and every key is then "maybe".

Sized at ``COUNTERS_PER_KEY`` counters per key the tiers can hold (at least
``MIN_COUNTERS``): about one "maybe" in 16 for a key that is not held.

Trust and lifetime (the region's rules, ``tiercache.region.shm``): only the service user
writes the map. Its name is in the world-writable ``/dev/shm``, so whatever is found there
is opened non-blocking without following links and judged on the descriptor (a regular
file, ours, mode 0600, long enough); anything else (another user's FIFO, file or symlink)
is refused with one line naming its type, owner and mode: the coordinator does not start
over it, an engine reads "maybe" for every key. The coordinator holds ``LOCK_EX`` on the
map for its whole life, so a map whose lock is free belongs to a coordinator that is gone
(``tiercache clean`` removes it, ``tiercache.region.stale``); a starting coordinator
retires the previous map only with its lock taken.

Engines read with ``pread`` on the descriptor they checked, never through a mapping: a map
cut short under a reader (by a process of the service user; nobody else may write it) is
a short read, answered "maybe", not a SIGBUS in the scheduler. A key costs one ``pread``
(about 0.9 µs on the development VM, 0.16 µs through a mapping), once per new request.
The EXACT flag is read once per scheduler step (``exact``), so a retired map's zeros may
be trusted for the rest of a step: a miss that costs one recomputed block, never a byte.
The coordinator never shrinks the map; it writes through its mapping and checks the size
on its descriptor before each batch (a map found cut short is dropped with one error
line, and nothing is counted in it after: engines read "maybe").
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterable, Sized
from itertools import islice

import numpy as np
import posix_ipc

from tiercache.errors import (
    RegionError, RegionExistsError, RegionNotFoundError, RegionTrustError,
)
from tiercache.region.shm import (
    REGION_MODE, SHM_DIR, OpenEntry, check_trusted, describe_name, open_entry, read_prefix,
    still_named, take_owner_lock, unlink_if_same,
)

log = logging.getLogger(__name__)

PREFIX = "tiercache_keys-"  # not "tiercache-": region listings never see these
WHAT = "key presence map"
MAGIC = b"TCKEYS01"
VERSION = 1
FLAG_EXACT = 1
FLAGS_OFFSET = 12
HEADER_BYTES = 64
_HEADER = struct.Struct("<8sIIQQ")
COUNTERS_PER_KEY = 16
MIN_COUNTERS = 1 << 16
SATURATED = 255
BULK_KEYS = 1 << 14  # a batch this large is counted with numpy (a restart's whole index)
# How long a starting coordinator retries the lock of the previous map: a probe of
# `status`/`clean` holds it for microseconds (the region's CLAIM_RETRY_S, for the same reason).
RETIRE_RETRY_S = 2.0
_POLL_S = 0.005
NOT_RUNNING = "no key presence map (the coordinator is not running)"
CLOSED = "closed"
_ROUTINE = (NOT_RUNNING, CLOSED)  # why a view has no map that is no news
_IGNORED = "not a key presence map of this user: ignored, every key is asked of the coordinator"


def presence_shm_name(instance: str) -> str:
    return PREFIX + instance


def presence_path(instance: str) -> str:
    return os.path.join(SHM_DIR, presence_shm_name(instance))


def num_counters_for(num_keys: int) -> int:
    """A power of two, at least ``COUNTERS_PER_KEY`` per key and ``MIN_COUNTERS``."""
    want = max(MIN_COUNTERS, COUNTERS_PER_KEY * max(1, num_keys))
    return 1 << (want - 1).bit_length()


def _count_bulk(counts: np.ndarray, mask: int, keys: Iterable[bytes], removed: bool) -> None:
    """``update``'s counting for a batch as large as a whole index (a restart tells the map
    every key it recovered): the same counts as one key at a time, in numpy, ``BULK_KEYS``
    at a time (temporaries of a few hundred KiB, which the heap reuses: whole-batch arrays
    left ~40 B a key of freed heap in the coordinator after a restart)."""
    crcs = map(zlib.crc32, keys)
    while (slots := np.fromiter(islice(crcs, BULK_KEYS), np.uint64)).size:
        where, times = np.unique(slots & np.uint64(mask), return_counts=True)
        now = counts[where].astype(np.int64)
        moved = np.maximum(now - times, 0) if removed else np.minimum(now + times, SATURATED)
        counts[where] = np.where(now < SATURATED, moved, now)


def has_map_magic(fd: int) -> bool:
    """Whether the open object starts with the map's magic (provably a map of tiercache)."""
    return read_prefix(fd, len(MAGIC)) == MAGIC


class PresenceMap:
    """The coordinator's side: creates the object (retiring one a killed coordinator left
    behind), holds its lock, counts keys in and out, removes it at close. Thread safe (its
    own lock, taken last: callers may hold the index's or a tier's lock).

    Raises ``RegionTrustError`` (one line naming it) when the name holds anything but a map
    of ours, ``RegionExistsError`` when another process keeps the previous map locked."""

    def __init__(self, instance: str, num_keys: int, region_id: int):
        self.path = presence_path(instance)
        self._shm_name = presence_shm_name(instance)
        self._n = num_counters_for(num_keys)
        self._mask = self._n - 1
        self._size = HEADER_BYTES + self._n
        self._lock = threading.Lock()
        self._exact = True
        self._mmap: mmap.mmap | None = None
        self._counts: memoryview | None = None
        _retire(self._shm_name)  # left by a coordinator that was killed
        try:
            shm = posix_ipc.SharedMemory("/" + self._shm_name, flags=posix_ipc.O_CREX,
                                         mode=REGION_MODE)
        except posix_ipc.ExistentialError:
            raise RegionExistsError(f"{self.path} appeared while this coordinator started "
                                    f"({describe_name(self.path)})") from None
        except (posix_ipc.Error, OSError, ValueError) as e:
            raise RegionError(f"cannot create the key presence map {self.path}: {e}") from e
        self._entry: OpenEntry | None = OpenEntry(self._shm_name, shm.fd, os.fstat(shm.fd))
        try:
            _lock_for_life(shm.fd, self.path)
            os.fchmod(shm.fd, REGION_MODE)
            os.posix_fallocate(shm.fd, 0, self._size)  # not sparse: a full tmpfs is an error now
            self._mmap = mmap.mmap(shm.fd, self._size)
        except OSError as e:
            self._release()
            raise RegionError(f"cannot set up the key presence map {self.path}: {e}") from e
        self._counts = memoryview(self._mmap)[HEADER_BYTES:]
        self._mmap[:_HEADER.size] = _HEADER.pack(MAGIC, VERSION, FLAG_EXACT, self._n, region_id)

    @property
    def num_counters(self) -> int:
        return self._n

    def _intact(self) -> bool:
        """Whether the map is still mapped and as long as it was made (call with the lock
        held). A map cut short (someone of our uid truncated it) would fault on the next
        write: it is dropped instead, with one error line, and nothing is counted after."""
        if self._counts is None or self._entry is None:
            return False
        size = os.fstat(self._entry.fd).st_size
        if size >= self._size:
            return True
        log.error("the key presence map %s was cut short to %d bytes (it had %d) by another "
                  "process of this user: keys are no longer counted in it, engines read every "
                  "key as 'maybe' (restart the coordinator to make a new one)", self.path, size,
                  self._size)
        self._unmap()
        return False

    def set_exact(self, exact: bool) -> None:
        """Clear EXACT for a tier whose keys are not counted here (every key is "maybe")."""
        with self._lock:
            self._exact = exact
            if self._intact() and self._mmap is not None:
                struct.pack_into("<I", self._mmap, FLAGS_OFFSET, FLAG_EXACT if exact else 0)

    def update(self, keys: Iterable[bytes], removed: bool) -> None:
        """Count ``keys`` in (one tier now holds each) or out (``removed``)."""
        mask, crc = self._mask, zlib.crc32
        with self._lock:
            counts = self._counts
            if counts is None or not self._intact():
                return
            if isinstance(keys, Sized) and len(keys) >= BULK_KEYS:
                _count_bulk(np.frombuffer(counts, np.uint8), mask, keys, removed)
            elif removed:
                for key in keys:
                    i = crc(key) & mask
                    c = counts[i]
                    if 0 < c < SATURATED:
                        counts[i] = c - 1
            else:
                for key in keys:
                    i = crc(key) & mask
                    c = counts[i]
                    if c < SATURATED:
                        counts[i] = c + 1

    def maybe_held(self, key: bytes) -> bool:
        counts = self._counts
        return not self._exact or counts is None or counts[zlib.crc32(key) & self._mask] != 0

    def _unmap(self) -> None:
        if self._counts is not None:
            self._counts.release()
            self._counts = None
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None

    def _release(self) -> None:
        """Unlink the name if it is still ours (we hold its lock), unmap, close (which
        drops the lock)."""
        self._unmap()
        if self._entry is not None:
            unlink_if_same(self._entry)
            self._entry.close()
            self._entry = None

    def close(self) -> None:
        """Clear EXACT (engines that still read it answer "maybe" until they open the next
        coordinator's, see ``PresenceView.refresh``), remove the object, unmap it."""
        self.set_exact(False)
        with self._lock:
            self._release()


def _lock_for_life(fd: int, path: str) -> None:
    """Take the map's owner lock (the coordinator's liveness signal), retrying while a probe
    of `status` or `clean` holds it shared for its few microseconds."""
    deadline = time.monotonic() + RETIRE_RETRY_S
    while not take_owner_lock(fd):
        if time.monotonic() >= deadline:
            raise OSError(f"{path} stayed locked for {RETIRE_RETRY_S:.0f} s by another "
                          "process of this user")
        time.sleep(_POLL_S)


def _retire(shm_name: str) -> None:
    """Clear EXACT in the map a killed coordinator left (engines still reading it stop
    trusting its zeros), then unlink it; only a regular file of ours, with its lock taken.
    Raises ``RegionTrustError`` for anything else under the name (left as found)."""
    deadline = time.monotonic() + RETIRE_RETRY_S
    while True:
        try:
            entry = open_entry(shm_name, writable=True, what=WHAT)
        except RegionNotFoundError:
            return
        try:
            check_trusted(entry, WHAT)
            if take_owner_lock(entry.fd):
                if not still_named(entry):
                    continue  # replaced since we opened it: look again
                if has_map_magic(entry.fd) and entry.st.st_size >= HEADER_BYTES:
                    os.pwrite(entry.fd, struct.pack("<I", 0), FLAGS_OFFSET)
                unlink_if_same(entry)
                return
            if time.monotonic() >= deadline:
                raise RegionExistsError(
                    f"{entry.path} stayed locked for {RETIRE_RETRY_S:.0f} s: another "
                    "coordinator of this instance name still holds it (was its region removed "
                    "under it?); stop it first, or choose another instance.name")
        finally:
            entry.close()
        time.sleep(_POLL_S)


def remove_stale_presence(instance: str, dry_run: bool = False) -> bool:
    """Unlink the map of ``instance`` if it is provably ours and provably stale: a regular
    file of ours with mode 0600 and the map's magic, whose lock nobody holds (its
    coordinator is gone), unlinked with that lock taken and only if the name still refers
    to it. Returns whether it was (with ``dry_run``: would be) removed; anything else under
    the name is left alone (``tiercache.region.stale`` lists it with the reason)."""
    try:
        entry = open_entry(presence_shm_name(instance), writable=False, what=WHAT)
    except RegionError:
        return False
    try:
        check_trusted(entry, WHAT)
        if not has_map_magic(entry.fd) or not take_owner_lock(entry.fd):
            return False
        return dry_run or unlink_if_same(entry)
    except RegionTrustError:
        return False
    finally:
        entry.close()  # also drops our lock


class PresenceView:
    """An engine's read-only view of one instance's map. ``maybe_held(key)`` for a key of
    the namespace ``prefix`` (``set_prefix`` after a reset); with no map (none yet, one that
    is not ours, a damaged one) every key is "maybe", which is what engines did before the
    map existed. ``problem`` says why there is no map; a new one is logged once."""

    def __init__(self, instance: str, prefix: bytes = b""):
        self.path = presence_path(instance)
        self._shm_name = presence_shm_name(instance)
        self._seed = zlib.crc32(prefix)
        self._entry: OpenEntry | None = None
        self._exact = False  # the EXACT flag as last read (``exact``)
        self._mask = 0
        self._size = 0
        self.problem: str | None = None  # why there is no map (None while one is open)
        self._logged: str | None = None  # the last problem logged (each is logged once)
        self._quiet = True  # the engine reports the first answer itself
        self.refresh()
        self._quiet = False
        self._logged = self.problem

    def set_prefix(self, prefix: bytes) -> None:
        self._seed = zlib.crc32(prefix)

    @property
    def mapped(self) -> bool:
        """Whether a map is open (read through its descriptor, see the module docstring)."""
        return self._entry is not None

    def exact(self) -> bool:
        """Whether the map's EXACT flag is set, read now (and kept for ``maybe_held``)."""
        entry = self._entry
        self._exact = False
        if entry is not None:
            try:
                flags = os.pread(entry.fd, 1, FLAGS_OFFSET)
            except OSError:
                flags = b""
            self._exact = bool(flags) and bool(flags[0] & FLAG_EXACT)
        return self._exact

    def maybe_held(self, key: bytes) -> bool:
        """False only when the map was EXACT at the last ``exact()`` or ``refresh()`` (the
        scheduler asks every step) and the key's counter is zero now. A read past the end
        of a map cut short is "maybe"."""
        entry = self._entry
        if entry is None or not self._exact:
            return True
        try:
            count = os.pread(entry.fd, 1,
                             HEADER_BYTES + (zlib.crc32(key, self._seed) & self._mask))
        except OSError:
            return True
        return not count or count[0] != 0

    def refresh(self) -> bool:
        """Open the object now under the name if it is not the one open (a coordinator
        restarted); returns whether a map is open after. Never blocks (see the module
        docstring)."""
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            self._drop(NOT_RUNNING)
            return False
        entry = self._entry
        if entry is not None and (st.st_dev, st.st_ino) == (entry.st.st_dev, entry.st.st_ino):
            size = os.fstat(entry.fd).st_size
            if size >= self._size:
                self.exact()
                return True
            self._drop(f"{self.path} was cut short to {size} bytes (the map has "
                       f"{self._size}); ignored: every key is looked up in the coordinator")
            return False
        self._drop(None)
        try:
            entry = open_entry(self._shm_name, writable=False, what=WHAT)
        except RegionNotFoundError:
            self._drop(NOT_RUNNING)
            return False
        except RegionTrustError as e:
            self._drop(f"{e}; {_IGNORED}")
            return False
        problem = self._check(entry)
        if problem is not None:
            entry.close()
            self._drop(problem)
            return False
        self._entry = entry
        self.problem = self._logged = None
        self.exact()
        return True

    def _check(self, entry: OpenEntry) -> str | None:
        """Why ``entry`` is not a map to read (None if it is one): ours, mode 0600, our
        format, as long as its header says."""
        try:
            check_trusted(entry, WHAT)
        except RegionTrustError as e:
            return f"{e}; {_IGNORED}"
        raw = read_prefix(entry.fd, _HEADER.size)
        if len(raw) < _HEADER.size:
            return f"{self.path} is {len(raw)} bytes, shorter than a map's header; ignored"
        magic, version, _, n, _ = _HEADER.unpack(raw)
        if magic != MAGIC or version != VERSION or not n or n & (n - 1):
            return f"{self.path} is not a key presence map of format {VERSION}; ignored"
        size = os.fstat(entry.fd).st_size
        if size < HEADER_BYTES + n:
            return (f"{self.path} was cut short to {size} bytes (its header says "
                    f"{HEADER_BYTES + n}); ignored: every key is looked up in the coordinator")
        self._mask, self._size = n - 1, HEADER_BYTES + n
        return None

    def _drop(self, problem: str | None) -> None:
        self._exact = False
        if self._entry is not None:
            self._entry.close()
            self._entry = None
        self.problem = problem
        if problem is None or problem in _ROUTINE or problem == self._logged:
            return
        if not self._quiet:
            log.warning("tiercache: %s", problem)
        self._logged = problem

    def close(self) -> None:
        self._drop(CLOSED)


__all__ = ["PresenceMap", "PresenceView", "has_map_magic", "num_counters_for",
           "presence_path", "remove_stale_presence"]
