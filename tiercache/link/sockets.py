"""Who is on the other end of the control socket, and whether its path can be trusted.

Both sides check: the server accepts a client only if the client's uid (``SO_PEERCRED``,
recorded by the kernel at connect) is trusted, and the client talks to a server only if
the listener's uid is trusted. *Trusted* is our own effective uid, plus the one
``control.trusted_uid`` names (say, root's for a `tiercache status` run by an operator).
File modes alone are not enough: root passes any mode, and a path in a directory that
someone else can write to may be replaced between a check and a connect.

Directory rules (the socket's immediate directory):

* it must be a directory owned by a trusted uid or root (its owner could swap the socket);
* if group or others may write to it, it must be sticky (like ``/tmp``), so that only a
  file's owner can remove or rename it, and the socket in it must be owned by a trusted uid;
* the default directory without ``XDG_RUNTIME_DIR`` is ``/tmp/tiercache-<uid>``, created
  0700 by the server; if it exists it must be ours with no group/other access.
"""

from __future__ import annotations

import logging
import os
import pwd
import socket
import stat
import struct

from tiercache.errors import ControlSocketError
from tiercache.link.protocol import MAX_SOCKET_PATH_BYTES

log = logging.getLogger(__name__)

_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def describe_uid(uid: int) -> str:
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def trusted_uids(extra_uid: int | None) -> frozenset[int]:
    """Our effective uid, and ``extra_uid`` if given."""
    return frozenset({os.geteuid()} | ({extra_uid} if extra_uid is not None else set()))


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end, as the kernel recorded them."""
    return _CRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))


def check_directory(directory: str, trusted: frozenset[int]) -> None:
    """Raise ``ControlSocketError`` unless ``directory`` may hold our socket (rules above);
    ``FileNotFoundError`` if it does not exist."""
    st = os.stat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise ControlSocketError(f"control socket directory {directory!r} is not a directory")
    if st.st_uid not in trusted and st.st_uid != 0:
        raise ControlSocketError(
            f"control socket directory {directory!r} belongs to {describe_uid(st.st_uid)}, who "
            "could replace the socket; use a directory of your own (control.socket)")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise ControlSocketError(
            f"control socket directory {directory!r} is writable by others (mode "
            f"{stat.S_IMODE(st.st_mode):04o}) and not sticky: anyone could replace the socket; "
            "use a private directory (control.socket)")


def prepare_directory(path: str, trusted: frozenset[int]) -> None:
    """The server's side: create the socket's directory 0700 if it is missing, then check
    it (a directory that exists under our private default name must be private)."""
    directory = os.path.dirname(os.path.abspath(path))
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    except OSError as e:
        raise ControlSocketError(f"cannot create the control socket directory "
                                 f"{directory!r}: {e}") from e
    check_directory(directory, trusted)
    _check_private(directory)


def _check_private(directory: str) -> None:
    """Our private default directory (``/tmp/tiercache-<uid>``) must be 0700."""
    if os.path.basename(directory) == f"tiercache-{os.geteuid()}":
        mode = stat.S_IMODE(os.stat(directory).st_mode)
        if mode & 0o077:
            raise ControlSocketError(f"private socket directory {directory!r} has mode "
                                     f"{mode:04o}; it must be 0700 (remove it or chmod 700 it)")


def check_socket_file(path: str, trusted: frozenset[int]) -> None:
    """Raise ``ControlSocketError`` unless ``path`` is a socket owned by a trusted uid;
    ``FileNotFoundError`` if nothing is there."""
    st = os.lstat(path)
    if not stat.S_ISSOCK(st.st_mode):
        raise ControlSocketError(f"control socket path {path!r} exists and is not a socket; "
                                 "remove it or choose another control.socket")
    if st.st_uid not in trusted:
        raise ControlSocketError(f"control socket {path!r} belongs to {describe_uid(st.st_uid)}, "
                                 "not to a trusted user (control.trusted_uid)")


def check_peer(sock: socket.socket, trusted: frozenset[int], what: str) -> None:
    """Raise ``ControlSocketError`` unless the process at the other end runs as a trusted uid."""
    pid, uid, _ = peer_credentials(sock)
    if uid not in trusted:
        raise ControlSocketError(
            f"{what} runs as {describe_uid(uid)} (pid {pid}); only "
            f"{', '.join(describe_uid(u) for u in sorted(trusted))} may be trusted "
            "(control.trusted_uid)")


class SocketFile:
    """The control socket's file on the server's side: bound in a checked directory (created
    0700 if missing), owner-only before anyone can connect, a stale socket of ours (nobody
    listening) replaced, a live one or someone else's refused; unlinked only while it is
    still the file we bound (never a successor's)."""

    def __init__(self, path: str, trusted: frozenset[int], backlog: int):
        self.path, self._trusted, self._backlog = path, trusted, backlog
        self._inode: tuple[int, int] | None = None

    def check(self) -> None:
        """What ``bind`` would refuse, found without creating or removing anything (the
        coordinator's start checks it before it allocates the region): a path too long,
        a directory that is not trusted or cannot be made, a file that is not a socket of
        ours, a live process serving it."""
        self._check_length()
        directory = os.path.dirname(os.path.abspath(self.path))
        try:
            check_directory(directory, self._trusted)
        except FileNotFoundError:
            parent = os.path.dirname(directory)
            if not os.access(parent, os.W_OK | os.X_OK, effective_ids=True):
                raise ControlSocketError(
                    f"cannot create the control socket directory {directory!r}: "
                    f"{parent!r} is missing or not writable by {describe_uid(os.geteuid())} "
                    "(control.socket)") from None
            return
        _check_private(directory)
        try:
            check_socket_file(self.path, self._trusted)
        except FileNotFoundError:
            return
        if self._served():
            raise ControlSocketError(self._live_message())

    def _check_length(self) -> None:
        if len(os.fsencode(self.path)) > MAX_SOCKET_PATH_BYTES:
            raise ControlSocketError(
                f"control socket path {self.path!r} is {len(os.fsencode(self.path))} bytes; "
                f"Unix sockets allow at most {MAX_SOCKET_PATH_BYTES}")

    def _served(self) -> bool:
        """Whether a process accepts connections on the socket at ``path`` now."""
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(self.path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        finally:
            probe.close()
        return True

    def _live_message(self) -> str:
        return (f"control socket {self.path!r} is served by a live process; is another "
                "coordinator running with this config?")

    def bind(self) -> socket.socket:
        """A listening, non-blocking socket on ``path``."""
        path = self.path
        self._check_length()
        prepare_directory(path, self._trusted)
        self._remove_stale(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(path)
            # Nobody can connect before listen(), so the mode is owner-only from the first connect.
            os.chmod(path, 0o600)
            st = os.stat(path)
            self._inode = (st.st_dev, st.st_ino)
            sock.listen(self._backlog)
            sock.setblocking(False)
        except OSError as e:
            sock.close()
            raise ControlSocketError(f"cannot serve the control socket {path!r}: {e}") from e
        return sock

    def _remove_stale(self, path: str) -> None:
        try:
            check_socket_file(path, self._trusted)  # never probe or unlink someone else's
        except FileNotFoundError:
            return
        if self._served():
            raise ControlSocketError(self._live_message())
        log.info("removing stale control socket %s", path)
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def unlink(self) -> None:
        if self._inode is None:
            return
        try:
            st = os.stat(self.path)
            if (st.st_dev, st.st_ino) == self._inode:
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._inode = None
