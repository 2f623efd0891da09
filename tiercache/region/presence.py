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
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
import threading
import zlib
from collections.abc import Iterable

import posix_ipc

from tiercache.errors import RegionError
from tiercache.region.shm import REGION_MODE, SHM_DIR

PREFIX = "tiercache_keys-"  # not "tiercache-": region listings never see these
MAGIC = b"TCKEYS01"
VERSION = 1
FLAG_EXACT = 1
HEADER_BYTES = 64
_HEADER = struct.Struct("<8sIIQQ")
COUNTERS_PER_KEY = 16
MIN_COUNTERS = 1 << 16
SATURATED = 255


def presence_shm_name(instance: str) -> str:
    return PREFIX + instance


def presence_path(instance: str) -> str:
    return os.path.join(SHM_DIR, presence_shm_name(instance))


def num_counters_for(num_keys: int) -> int:
    """A power of two, at least ``COUNTERS_PER_KEY`` per key and ``MIN_COUNTERS``."""
    want = max(MIN_COUNTERS, COUNTERS_PER_KEY * max(1, num_keys))
    return 1 << (want - 1).bit_length()


class PresenceMap:
    """The coordinator's side: creates the object (replacing one a killed coordinator left
    behind), counts keys in and out, removes it at close. Thread safe (its own lock, taken
    last: callers may hold the index's or a tier's lock)."""

    def __init__(self, instance: str, num_keys: int, region_id: int):
        self.path = presence_path(instance)
        self._shm_name = presence_shm_name(instance)
        self._n = num_counters_for(num_keys)
        self._mask = self._n - 1
        self._lock = threading.Lock()
        self._exact = True
        _retire(self.path, self._shm_name)  # left by a coordinator that was killed
        try:
            shm = posix_ipc.SharedMemory("/" + self._shm_name, flags=posix_ipc.O_CREX,
                                         mode=REGION_MODE, size=HEADER_BYTES + self._n)
        except (posix_ipc.Error, OSError, ValueError) as e:
            raise RegionError(f"cannot create the key presence map {self.path}: {e}") from e
        try:
            os.fchmod(shm.fd, REGION_MODE)
            self._mmap = mmap.mmap(shm.fd, HEADER_BYTES + self._n)
        except OSError as e:
            os.close(shm.fd)
            self._unlink()
            raise RegionError(f"cannot map the key presence map {self.path}: {e}") from e
        self._ino = os.fstat(shm.fd).st_ino
        os.close(shm.fd)
        self._counts = memoryview(self._mmap)[HEADER_BYTES:]
        self._mmap[:_HEADER.size] = _HEADER.pack(MAGIC, VERSION, FLAG_EXACT, self._n, region_id)

    @property
    def num_counters(self) -> int:
        return self._n

    def set_exact(self, exact: bool) -> None:
        """Clear EXACT for a tier whose keys are not counted here (every key is "maybe")."""
        with self._lock:
            self._exact = exact
            struct.pack_into("<I", self._mmap, 12, FLAG_EXACT if exact else 0)

    def update(self, keys: Iterable[bytes], removed: bool) -> None:
        """Count ``keys`` in (one tier now holds each) or out (``removed``)."""
        counts, mask, crc = self._counts, self._mask, zlib.crc32
        with self._lock:
            if removed:
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
        return not self._exact or self._counts[zlib.crc32(key) & self._mask] != 0

    def _unlink(self) -> None:
        try:
            st = os.lstat(self.path)
        except FileNotFoundError:
            return
        if getattr(self, "_ino", None) not in (None, st.st_ino):
            return  # another coordinator's since: not ours to remove
        try:
            posix_ipc.unlink_shared_memory("/" + self._shm_name)
        except posix_ipc.ExistentialError:
            pass

    def close(self) -> None:
        """Clear EXACT (engines that still map it answer "maybe" until they map the next
        coordinator's, see ``PresenceView.refresh``), remove the object, unmap it."""
        self.set_exact(False)
        self._unlink()
        self._counts.release()
        self._mmap.close()


def _retire(path: str, shm_name: str) -> None:
    """Clear EXACT in the map a killed coordinator left (engines still mapping it stop
    trusting its zeros), then unlink it; only a regular file of ours is touched."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    except OSError:
        return
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return
        if st.st_size >= HEADER_BYTES:
            os.pwrite(fd, struct.pack("<I", 0), 12)
        try:
            posix_ipc.unlink_shared_memory("/" + shm_name)
        except posix_ipc.ExistentialError:
            pass
    finally:
        os.close(fd)


def remove_stale_presence(instance: str) -> bool:
    """Unlink the map of an instance whose coordinator is gone (``tiercache clean`` calls
    this while it holds the stale region's owner lock); only a regular file of ours."""
    path = presence_path(instance)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
        return False
    try:
        posix_ipc.unlink_shared_memory("/" + presence_shm_name(instance))
    except posix_ipc.ExistentialError:
        return False
    return True


class PresenceView:
    """An engine's read-only view of one instance's map. ``maybe_held(key)`` for a key of
    the namespace ``prefix`` (``set_prefix`` after a reset); with no map (none yet, or a
    damaged one) every key is "maybe", which is what engines did before the map existed."""

    def __init__(self, instance: str, prefix: bytes = b""):
        self.path = presence_path(instance)
        self._shm_name = presence_shm_name(instance)
        self._seed = zlib.crc32(prefix)
        self._mmap: mmap.mmap | None = None
        self._counts: memoryview | None = None
        self._flags: memoryview | None = None
        self._mask = 0
        self._ino: int | None = None
        self.problem: str | None = None  # why there is no map (None while mapped)
        self.refresh()

    def set_prefix(self, prefix: bytes) -> None:
        self._seed = zlib.crc32(prefix)

    @property
    def mapped(self) -> bool:
        return self._counts is not None

    def exact(self) -> bool:
        return self._flags is not None and bool(self._flags[0] & FLAG_EXACT)

    def maybe_held(self, key: bytes) -> bool:
        """False only when the map is EXACT and the key's counter is zero."""
        counts = self._counts
        if counts is None or not self._flags[0] & FLAG_EXACT:
            return True
        return counts[zlib.crc32(key, self._seed) & self._mask] != 0

    def refresh(self) -> bool:
        """Map the object now under the name if it is not the one mapped (a coordinator
        restarted); returns whether a map is mapped after."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._drop("no key presence map (the coordinator is not running)")
            return False
        if self._counts is not None and st.st_ino == self._ino:
            return True
        self._drop(None)
        try:
            fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError as e:
            self._drop(f"cannot open {self.path}: {e.strerror}")
            return False
        try:
            st = os.fstat(fd)
            if (not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid()
                    or stat.S_IMODE(st.st_mode) != REGION_MODE or st.st_size < HEADER_BYTES):
                self._drop(f"{self.path} is not a key presence map of this user (mode "
                           f"{REGION_MODE:04o}); ignored")
                return False
            m = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        magic, version, _, n, _ = _HEADER.unpack_from(m)
        if magic != MAGIC or version != VERSION or n & (n - 1) or HEADER_BYTES + n > len(m):
            m.close()
            self._drop(f"{self.path} is not a key presence map of format {VERSION}; ignored")
            return False
        self._mmap, self._ino, self._mask = m, st.st_ino, n - 1
        self._counts = memoryview(m)[HEADER_BYTES:HEADER_BYTES + n]
        self._flags = memoryview(m)[12:13]  # the low byte of the flags word
        self.problem = None
        return True

    def _drop(self, problem: str | None) -> None:
        if self._counts is not None:
            self._counts.release()
            self._flags.release()
            self._counts = self._flags = None
        if self._mmap is not None:
            self._mmap.close()
            self._mmap = None
        self._ino = None
        self.problem = problem

    def close(self) -> None:
        self._drop("closed")


__all__ = ["PresenceMap", "PresenceView", "num_counters_for", "presence_path",
           "remove_stale_presence"]
