"""The disk tier's claim on its file: the directory checked, the file opened once and
locked, and the file's own header (who made it, for which geometry, who holds it now).

Trust rules (those of the control socket's directory, ``tiercache.link.sockets``):

* ``disk.path`` is opened once (``O_DIRECTORY``) and judged on that descriptor: it must be
  owned by us or root, and if group or others may write to it, sticky (like ``/tmp``).
  A symlink to a directory is judged by what it points to (another user's: refused). The
  file is then opened relative to that descriptor with ``O_NOFOLLOW`` (a symlink planted
  under the file's name is refused, never followed) and judged on its own descriptor: a
  regular file, ours, mode 0600. That one descriptor is the one every read and write uses
  (O_DIRECT is switched on it with ``fcntl``), so no rename between a check and a use can
  swap the file.
* Not ``/dev/shm`` (compared by device and inode, so a bind mount or a symlink of it is
  refused too): regions live there under ``tiercache-<name>``, and the disk file would be
  listed by ``status`` as a region and could be taken by ``clean`` for a stale one; a disk
  tier in memory is no disk tier either.
* **One coordinator per file.** The file is locked (``flock``, exclusive, on the open file
  description: held until the descriptor closes, released by the kernel when the process
  dies, and seen across containers that share the filesystem). A second opener gets one
  line naming the file and its holder (pid, host and since when, as the holder wrote them
  into the file's header).

File header (offset 0, ``FILE_HEADER_BYTES``; slots follow it), little-endian::

    offset  size  field
    0       8     magic          b"TCDFILE1"
    8       16    instance       random at creation: every slot header carries it, so a
                                 slot written by another file's instance is never served
    24      16    layout         the region's layout digest
    40      4     world_size     u32
    44      4     reserved
    48      8     row_stride     u64
    56      8     slot_bytes     u64
    64      8     created_ns     u64 (Unix time)
    72      64    name           the file's own name (``tiercache-<instance>.disk``)
    136     4     holder_pid     u32: the coordinator holding the lock now
    140     4     reserved
    144     64    holder_host    its host name
    208     8     holder_since   u64 ns (Unix time)
    216     4     header_crc     u32 CRC-32C of bytes 0..216
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import struct
import time
from dataclasses import dataclass, replace

from tiercache.errors import ConfigError
from tiercache.region.shm import SHM_DIR, describe, user_label
from tiercache.tiers.block_header import DIGEST_BYTES, checksum

FILE_MAGIC = b"TCDFILE1"
FILE_HEADER_BYTES = 4096
FILE_MODE = 0o600
_FILE = struct.Struct("<8s16s16sIIQQQ64sII64sQ")
_CRC = struct.Struct("<I")
assert _FILE.size == 216


@dataclass(frozen=True)
class FileHeader:
    instance: bytes
    layout: bytes
    world_size: int
    row_stride: int
    slot_bytes: int
    created_ns: int
    name: str
    holder_pid: int = 0
    holder_host: str = ""
    holder_since_ns: int = 0

    def encode(self) -> bytes:
        fields = _FILE.pack(FILE_MAGIC, self.instance, self.layout, self.world_size, 0,
                            self.row_stride, self.slot_bytes, self.created_ns,
                            _text(self.name), self.holder_pid, 0, _text(self.holder_host),
                            self.holder_since_ns)
        return fields + _CRC.pack(checksum([fields]))

    @classmethod
    def decode(cls, raw: bytes) -> FileHeader | None:
        """The header if ``raw`` starts with a whole one (magic, CRC), else None; never
        raises."""
        if len(raw) < _FILE.size + _CRC.size or raw[:8] != FILE_MAGIC:
            return None
        fields = raw[:_FILE.size]
        if checksum([fields]) != _CRC.unpack_from(raw, _FILE.size)[0]:
            return None
        (_, instance, layout, world, _, stride, slot_bytes, created, name, pid, _, host,
         since) = _FILE.unpack(fields)
        return cls(instance, layout, world, stride, slot_bytes, created, _untext(name), pid,
                   _untext(host), since)

    def held_by_me(self) -> FileHeader:
        return replace(self, holder_pid=os.getpid(), holder_host=socket.gethostname(),
                       holder_since_ns=time.time_ns())

    def describe_holder(self) -> str:
        if not self.holder_pid:
            return "holder unknown"
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(self.holder_since_ns / 1e9))
        return f"pid {self.holder_pid} on host {self.holder_host!r} since {since}"


def _text(value: str) -> bytes:
    return value.encode("utf-8", "replace")[:64]


def _untext(raw: bytes) -> str:
    return raw.rstrip(b"\0").decode("utf-8", "replace")


def new_instance() -> bytes:
    return os.urandom(DIGEST_BYTES)


def open_directory(directory: str) -> int:
    """A descriptor of ``directory`` once it passes the rules above (``ConfigError``)."""
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as e:
        raise ConfigError(f"disk.path = {directory!r}: cannot open it as a directory "
                          f"({e.strerror})") from e
    try:
        check_directory(directory, os.fstat(fd))
    except BaseException:
        os.close(fd)
        raise
    return fd


def check_directory(directory: str, st: os.stat_result) -> None:
    try:
        shm = os.stat(SHM_DIR)
        if (st.st_dev, st.st_ino) == (shm.st_dev, shm.st_ino):
            raise ConfigError(f"disk.path = {directory!r} is {SHM_DIR}, where the regions live "
                              "(the disk file would be listed as one, and a disk tier in "
                              "memory is no disk tier): choose a directory on a local disk")
    except FileNotFoundError:
        pass
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        raise ConfigError(f"disk.path = {directory!r} belongs to {user_label(st.st_uid)}, who "
                          "could replace or read the disk tier's file; use a directory of "
                          f"your own ({user_label(me)}) or root's")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise ConfigError(f"disk.path = {directory!r} is writable by others (mode "
                          f"{stat.S_IMODE(st.st_mode):04o}) and not sticky: anyone could "
                          "replace the disk tier's file; use a private directory")


@dataclass(frozen=True)
class Claim:
    """The claimed file's descriptor, and whether this claim created the file (a start
    that fails after it removes what it made: ``unclaim``)."""

    fd: int
    created: bool


def claim(path: str) -> Claim:
    """The file at ``path`` opened read-write (created 0600 if missing) in a checked
    directory, checked on its descriptor, and locked for this process; ``ConfigError``
    (one line) otherwise."""
    directory, name = os.path.split(os.path.abspath(path))
    dir_fd = open_directory(directory)
    flags = os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        try:
            try:
                fd, created = os.open(name, flags | os.O_CREAT | os.O_EXCL, FILE_MODE,
                                      dir_fd=dir_fd), True
            except FileExistsError:
                fd, created = os.open(name, flags, dir_fd=dir_fd), False
        except OSError as e:
            raise ConfigError(_cannot_open(path, e)) from e
    finally:
        os.close(dir_fd)
    try:
        _check_file(path, os.fstat(fd))
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        _lock(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return Claim(fd, created)


def unclaim(path: str, claimed: Claim) -> None:
    """Close the claim's descriptor; remove the file if this claim created it and the
    name still refers to it (a start that failed leaves no empty file behind)."""
    try:
        if claimed.created:
            st, now = os.fstat(claimed.fd), os.lstat(path)
            if (st.st_dev, st.st_ino) == (now.st_dev, now.st_ino):
                os.unlink(path)
    except FileNotFoundError:
        pass
    finally:
        os.close(claimed.fd)


def check_claimable(path: str) -> int:
    """What ``claim`` would refuse, found without creating or locking anything: the
    directory's rules, a directory we cannot write a new file in, a file under the name
    that is not ours with mode 0600 or that another coordinator holds. Returns the bytes
    the file already has allocated (0 without one); ``ConfigError`` otherwise."""
    directory, name = os.path.split(os.path.abspath(path))
    dir_fd = open_directory(directory)
    try:
        try:
            fd = os.open(name, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                         dir_fd=dir_fd)
        except FileNotFoundError:
            if not os.access(directory, os.W_OK | os.X_OK, effective_ids=True):
                raise ConfigError(f"disk.path = {directory!r} is not writable by "
                                  f"{user_label(os.geteuid())}: the disk tier's file "
                                  f"{name} cannot be created there") from None
            return 0
        except OSError as e:
            raise ConfigError(_cannot_open(path, e)) from e
    finally:
        os.close(dir_fd)
    try:
        st = os.fstat(fd)
        _check_file(path, st)
        _lock(fd, path)  # released as the descriptor closes: a probe of the holder
    finally:
        os.close(fd)
    return st.st_blocks * 512


def _cannot_open(path: str, e: OSError) -> str:
    return (f"disk tier file {path}: cannot open it ({e.strerror}"
            + ("; a symlink is never followed" if e.errno == errno.ELOOP else "") + ")")


def _check_file(path: str, st: os.stat_result) -> None:
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise ConfigError(f"disk tier file {path} is not ours with mode 0600 ("
                          f"{describe(st)}); remove it or choose another disk.path")


def _lock(fd: int, path: str) -> None:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        header = FileHeader.decode(os.pread(fd, FILE_HEADER_BYTES, 0))
        holder = header.describe_holder() if header is not None else "holder unknown"
        raise ConfigError(f"disk tier file {path} is in use by another coordinator ({holder}); "
                          "two coordinators never share one disk file: give each its own "
                          "disk.path or instance.name") from None
