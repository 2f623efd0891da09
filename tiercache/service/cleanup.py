"""What ``tiercache clean`` removes besides regions: the control socket a dead coordinator
left behind.

A socket path is removed only if it is a socket owned by us that nobody serves
(connecting is refused), and only if it still is the inode that was checked. ``clean``
calls this while it holds the stale region's owner lock, so no coordinator of that
name can be between binding and listening (it would need that lock first), and a refused
connection really means nobody serves the socket.
"""

from __future__ import annotations

import os
import socket
import stat

from tiercache.errors import ControlSocketError

PROBE_TIMEOUT_S = 1.0


def stale_socket(path: str) -> bool:
    """True if ``path`` is a socket of ours that nobody serves."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stat.S_ISSOCK(st.st_mode) or st.st_uid != os.geteuid():
        return False
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(PROBE_TIMEOUT_S)
    try:
        probe.connect(path)
    except ConnectionRefusedError:
        return True
    except OSError:  # gone, or cannot tell (a full backlog, a timeout): keep it
        return False
    finally:
        probe.close()
    return False  # somebody serves it


def remove_stale_socket(path: str, dry_run: bool = False) -> bool:
    """Unlink ``path`` if it is a stale socket of ours (see ``stale_socket``); returns
    whether it was (with ``dry_run``: would be) removed."""
    try:
        checked = os.lstat(path)
    except FileNotFoundError:
        return False
    if not stale_socket(path):
        return False
    if dry_run:
        return True
    try:
        now = os.lstat(path)
        if (now.st_dev, now.st_ino) != (checked.st_dev, checked.st_ino):
            return False
        os.unlink(path)
    except FileNotFoundError:
        return False
    except OSError as e:
        raise ControlSocketError(f"cannot remove the stale socket {path}: {e.strerror}") from e
    return True
