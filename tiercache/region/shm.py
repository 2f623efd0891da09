"""tiercache's POSIX shared-memory objects (the region, the key presence map beside it):
create, open, check, lock and unlink them.

Decisions and their reasons:

* Objects are made and removed with ``posix_ipc.SharedMemory`` / ``unlink_shared_memory``
  (shm_open semantics): create is ``O_CREAT|O_EXCL`` with mode 0600 (then ``fchmod``, so
  a strict umask cannot leave it 0000), size 0 (the coordinator ``posix_fallocate``\\ s:
  ftruncate would leave it sparse, and a sparse region that later overflows tmpfs is a
  SIGBUS). glibc's shm_open adds ``O_NOFOLLOW|O_CLOEXEC``: a symlink under a region's name
  is never followed, and no exec'd child inherits a descriptor (and with it the owner lock).
* Every open passes ``O_NONBLOCK`` (posix_ipc hands its flags to shm_open unchanged) and
  is followed by ``fstat`` of the descriptor: a FIFO, directory or device under a region's
  name is refused before anything reads from it, and opening a FIFO cannot block.
* Trust is decided on the open descriptor, never on the path again: a region is mapped,
  re-adopted or replaced only if it is a regular file owned by our effective uid with mode
  0600 (anyone else who could write it could read or corrupt the cache).
* Liveness is an ``flock`` on the object. Its coordinator holds ``LOCK_EX`` for life; the
  kernel drops it when the process dies, SIGKILL included. Probes (``status``, ``clean``'s
  listing) take ``LOCK_SH|LOCK_NB`` and drop it at once: that fails only while an exclusive
  holder exists, and probes never conflict with each other. A probe can still make an
  exclusive attempt fail for its few microseconds, so whoever wants the lock of a region
  whose recorded coordinator is dead retries (``SharedOffloadRegion.create``).
* Size is checked against the header before anything maps the region (``truncation``): a
  file cut short (a stale region truncated by hand or by a full disk tool) would map, then
  fault on the first touch past its end; mmap itself refuses only with a bare ValueError.
  Probes (headers, magics, recorded owners) read with ``pread``, never through a mapping:
  a file cut short under a probe is a short read, not a SIGBUS.
* ``shm_unlink`` removes by name, so ``unlink_if_same`` first compares the name's inode
  with the one that was checked, while the caller holds that object's lock: nobody can
  then have replaced it legitimately, and a replacement made anyway is left alone.

What posix_ipc does not keep: errno on its own exceptions (EACCES, EEXIST, ENOENT and
EINVAL become ``PermissionsError``, ``ExistentialError`` and ``ValueError``), so after a
failed open the name is ``lstat``-ed to say what is there; that message is all the path
is used for.
"""

from __future__ import annotations

import errno
import fcntl
import os
import pwd
import stat
import struct
from dataclasses import dataclass

import posix_ipc

from tiercache.errors import (
    LayoutMismatchError, RegionError, RegionExistsError, RegionNotFoundError, RegionTruncatedError,
    RegionTrustError,
)
from tiercache.region.header import MAGIC, HeaderInfo, RegionHeader
from tiercache.region.layout import FORMAT_VERSION, HEADER_FIXED_BYTES

SHM_DIR = "/dev/shm"  # where glibc's shm_open keeps its objects
NAME_PREFIX = "tiercache-"
REGION_MODE = 0o600
# The header's owner_pid and owner_start_ns (``tiercache.region.header``).
HEADER_OWNER_OFFSET = 40
_OWNER = struct.Struct("<QQ")
HEADER_OWNER_END = HEADER_OWNER_OFFSET + _OWNER.size

_KINDS = (
    (stat.S_ISREG, "a regular file"), (stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISLNK, "a symlink"), (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
)


@dataclass(frozen=True)
class OpenEntry:
    """An open shared-memory object and the ``fstat`` taken right after opening it."""

    shm_name: str  # "tiercache-<instance name>", without shm_open's leading slash
    fd: int
    st: os.stat_result

    @property
    def path(self) -> str:
        return shm_path(self.shm_name)

    def close(self) -> None:
        os.close(self.fd)


def shm_path(shm_name: str) -> str:
    return os.path.join(SHM_DIR, shm_name)


def user_label(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


def describe(st: os.stat_result) -> str:
    """``a FIFO owned by root (uid 0) with mode 0600``."""
    kind = next((word for test, word in _KINDS if test(st.st_mode)), "an unknown file type")
    return f"{kind} owned by {user_label(st.st_uid)} with mode {stat.S_IMODE(st.st_mode):04o}"


def describe_name(path: str) -> str:
    """What ``path`` holds, from ``lstat``: for messages only, never for a decision."""
    try:
        return describe(os.lstat(path))
    except FileNotFoundError:
        return "gone"


def create_entry(shm_name: str) -> OpenEntry:
    """A new, empty object of mode 0600; ``RegionExistsError`` if the name is taken."""
    path = shm_path(shm_name)
    try:
        shm = posix_ipc.SharedMemory("/" + shm_name, flags=posix_ipc.O_CREX, mode=REGION_MODE)
    except posix_ipc.ExistentialError:
        raise RegionExistsError(f"{path} already exists ({describe_name(path)})") from None
    except (posix_ipc.Error, OSError, ValueError) as e:
        raise RegionError(f"cannot create {path}: {e}") from e
    try:
        os.fchmod(shm.fd, REGION_MODE)
        return OpenEntry(shm_name, shm.fd, os.fstat(shm.fd))
    except OSError as e:
        os.close(shm.fd)
        raise RegionError(f"cannot set up {path}: {e}") from e


def open_entry(shm_name: str, *, writable: bool, what: str = "region") -> OpenEntry:
    """Open an existing object without blocking and check that it is a regular file.

    Raises ``RegionNotFoundError`` if nothing has the name, ``RegionTrustError`` if what
    has it is not a regular file or cannot be opened by this user. Owner and mode are
    ``check_trusted``'s business: listings show regions they may not use. ``what`` names
    the kind of object in messages (the region, the key presence map)."""
    path = shm_path(shm_name)
    try:
        shm = posix_ipc.SharedMemory("/" + shm_name, flags=posix_ipc.O_NONBLOCK,
                                     read_only=not writable)
    except posix_ipc.ExistentialError:
        raise RegionNotFoundError(f"no {what} {path}") from None
    except (posix_ipc.Error, OSError, ValueError) as e:
        found = describe_name(path)
        if found == "gone":
            raise RegionNotFoundError(f"no {what} {path}") from None
        if not found.startswith("a regular file"):
            raise RegionTrustError(_not_ours(path, found, what)) from None
        raise RegionTrustError(f"{path} is {found}: {user_label(os.geteuid())} may not open "
                               f"it ({_reason(e)}); tiercache leaves it alone") from e
    st = os.fstat(shm.fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(shm.fd)
        raise RegionTrustError(_not_ours(path, describe(st), what))
    return OpenEntry(shm_name, shm.fd, st)


def _not_ours(path: str, found: str, what: str) -> str:
    return (f"{path} is {found}: not a {what} file; tiercache leaves it alone (remove it, or "
            "choose another instance.name)")


def _reason(e: BaseException) -> str:
    if isinstance(e, posix_ipc.PermissionsError):
        return os.strerror(errno.EACCES)
    return str(e)


def check_trusted(entry: OpenEntry, what: str = "region") -> None:
    """Refuse an object that is not ours with mode 0600 (see the module docstring)."""
    st = entry.st
    if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) != REGION_MODE:
        raise RegionTrustError(
            f"{entry.path} is {describe(st)}; tiercache uses a {what} only if it is a regular "
            f"file owned by {user_label(os.geteuid())} with mode {REGION_MODE:04o} (check who "
            "made it, then remove it or choose another instance.name)")


def still_named(entry: OpenEntry) -> bool:
    """True while the name refers to the object ``entry`` holds open."""
    try:
        now = os.lstat(entry.path)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (entry.st.st_dev, entry.st.st_ino)


def unlink_if_same(entry: OpenEntry) -> bool:
    """Unlink the name if it still refers to ``entry`` (call with its lock held)."""
    if not still_named(entry):
        return False
    try:
        posix_ipc.unlink_shared_memory("/" + entry.shm_name)
    except posix_ipc.ExistentialError:
        return False
    return True


# ---------------------------------------------------------------------- the owner lock
def take_owner_lock(fd: int) -> bool:
    """Take the exclusive owner lock without waiting; False if anyone holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def owner_lock_held(fd: int) -> bool:
    """Probe: True while an exclusive holder (a coordinator) exists; holds nothing after."""
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    fcntl.flock(fd, fcntl.LOCK_UN)
    return False


# ---------------------------------------------------------------------- the header
def read_prefix(fd: int, num_bytes: int) -> bytes:
    """The first ``num_bytes`` of an open object (fewer if it is shorter), read with
    ``pread``: a probe never maps what it has not checked, so a file cut short under it
    is a short read, never a SIGBUS."""
    return os.pread(fd, num_bytes, 0)


def has_region_magic(fd: int) -> bool:
    """Whether the open object starts with the region header's magic: provably a region
    (perhaps cut short), not some other file that happens to carry a region's name."""
    return read_prefix(fd, len(MAGIC)) == MAGIC


def read_header(fd: int) -> HeaderInfo | None:
    """The header of an open region, or None if it is too short or not (yet) valid."""
    raw = read_prefix(fd, HEADER_FIXED_BYTES)
    if len(raw) < HEADER_FIXED_BYTES:
        return None
    header = RegionHeader(raw)
    if not header.has_magic():
        return None
    try:
        return header.read()
    except LayoutMismatchError:
        return None


def other_format_version(fd: int) -> int | None:
    """The format version of an open region made by a tiercache of another
    ``FORMAT_VERSION`` (the magic, then a version not ours), else None. Such a header is
    whole as its writer wrote it: never a region mid-creation."""
    raw = read_prefix(fd, len(MAGIC) + 4)
    if len(raw) < len(MAGIC) + 4 or raw[:len(MAGIC)] != MAGIC:
        return None
    (version,) = struct.unpack_from("<I", raw, len(MAGIC))
    return None if version == FORMAT_VERSION else version


def header_refusal(fd: int) -> str:
    """Why ``read_header`` found no header in an open region, in a few words: the format
    version when it is a region of another one (a coordinator re-adopts only a region of
    its own ``FORMAT_VERSION``: docs/deploy.md, "Upgrades and version skew")."""
    version = other_format_version(fd)
    if version is None:
        return "no valid header"
    return f"region format version {version}; this tiercache reads {FORMAT_VERSION}"


def recorded_owner(fd: int) -> tuple[int, int] | None:
    """(pid, process start time) of the coordinator a region's header names, read from
    the fixed fields even when the rest of the header is cut short or inconsistent; None
    without the magic or those fields."""
    raw = read_prefix(fd, HEADER_OWNER_END)
    if len(raw) < HEADER_OWNER_END or raw[:len(MAGIC)] != MAGIC:
        return None
    return _OWNER.unpack_from(raw, HEADER_OWNER_OFFSET)


def truncation(fd: int, info: HeaderInfo | None) -> str | None:
    """Why the open region cannot be mapped for its size, or None if it can:
    ``"truncated: N bytes, header says M"`` when it is shorter than the ``total_bytes`` of
    its header (``info``, from ``read_header``), or ``"truncated: N bytes, less than the
    4096-byte header"``. An empty file is not truncated: a new region is empty until its
    coordinator ``posix_fallocate``\\ s it whole, before it writes the header."""
    size_bytes = os.fstat(fd).st_size
    if info is not None and size_bytes < info.total_bytes:
        return f"truncated: {size_bytes} bytes, header says {info.total_bytes}"
    if 0 < size_bytes < HEADER_FIXED_BYTES:
        return (f"truncated: {size_bytes} bytes, less than the {HEADER_FIXED_BYTES}-byte "
                "header")
    return None


def check_size(entry: OpenEntry, info: HeaderInfo | None) -> None:
    """Raise ``RegionTruncatedError`` if the region is too short to map (see ``truncation``)."""
    why = truncation(entry.fd, info)
    if why is not None:
        raise RegionTruncatedError(f"{entry.path} is {why}: it cannot be mapped (cut short; "
                                   "once its coordinator is gone `tiercache clean` removes it)")
