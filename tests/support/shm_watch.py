"""``ShmWatch``: every name created in /dev/shm while it watches (inotify ``IN_CREATE``), so
a test can say an entry *never appeared*, not only that it is gone by the time it looks
(a start that created its region and removed it again looks the same afterwards)."""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import struct

SHM_DIR = b"/dev/shm"
IN_CREATE = 0x00000100
IN_Q_OVERFLOW = 0x00004000
IN_NONBLOCK = os.O_NONBLOCK
IN_CLOEXEC = os.O_CLOEXEC
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


class ShmWatch:
    def __init__(self) -> None:
        self._fd = _libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        if _libc.inotify_add_watch(self._fd, SHM_DIR, IN_CREATE) < 0:
            os.close(self._fd)
            raise OSError(ctypes.get_errno(), "inotify_add_watch /dev/shm")
        self._seen: list[str] = []

    def created(self) -> list[str]:
        """Every name created in /dev/shm since the watch began (what the kernel queued)."""
        while True:
            try:
                raw = os.read(self._fd, 1 << 16)
            except BlockingIOError:
                return list(self._seen)
            offset = 0
            while offset < len(raw):
                _, mask, _, length = _EVENT.unpack_from(raw, offset)
                if mask & IN_Q_OVERFLOW:  # events were lost: no "never" can be said
                    raise AssertionError("the /dev/shm watch overflowed")
                name = raw[offset + _EVENT.size:offset + _EVENT.size + length]
                self._seen.append(name.rstrip(b"\0").decode())
                offset += _EVENT.size + length

    def close(self) -> None:
        os.close(self._fd)

    def __enter__(self) -> ShmWatch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
