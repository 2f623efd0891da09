"""A real filesystem that fails on demand: a FUSE passthrough (fusepy) over a backing
directory, in a process of its own. Every read and write first reads the mode file:

* ``ok``: pass through;
* ``eio``: fail with EIO (what a dying disk returns);
* ``slow S``: sleep S seconds, then pass through (a saturated or failing disk).

So the coordinator's disk tier meets real kernel errors and real stalls, not a stand-in.
``FaultyFS(backing, mount)`` mounts and ``close()`` unmounts; ``set(mode)`` switches.
"""

from __future__ import annotations

import errno
import multiprocessing as mp
import os
import subprocess
import time

SPAWN = mp.get_context("spawn")
MOUNT_WAIT_S = 30.0


def available() -> bool:
    return os.path.exists("/dev/fuse")


def _serve(backing: str, mount: str, mode_path: str) -> None:
    from fuse import FUSE, FuseOSError, Operations

    def fault() -> None:
        try:
            with open(mode_path) as f:
                mode = f.read().split()
        except OSError:
            return
        if mode and mode[0] == "eio":
            raise FuseOSError(errno.EIO)
        if mode and mode[0] == "slow":
            time.sleep(float(mode[1]))

    class Passthrough(Operations):
        def _real(self, path: str) -> str:
            return os.path.join(backing, path.lstrip("/"))

        def getattr(self, path, fh=None):
            st = os.lstat(self._real(path))
            return {key: getattr(st, key) for key in (
                "st_atime", "st_ctime", "st_gid", "st_mode", "st_mtime", "st_nlink",
                "st_size", "st_uid")}

        def readdir(self, path, fh):
            return [".", "..", *os.listdir(self._real(path))]

        def statfs(self, path):
            sv = os.statvfs(self._real(path))
            return {key: getattr(sv, key) for key in (
                "f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree",
                "f_files", "f_flag", "f_frsize", "f_namemax")}

        def chmod(self, path, mode):
            os.chmod(self._real(path), mode)

        def create(self, path, mode, fi=None):
            return os.open(self._real(path), os.O_RDWR | os.O_CREAT, mode)

        def open(self, path, flags):
            return os.open(self._real(path), flags & ~os.O_DIRECT)

        def read(self, path, size, offset, fh):
            fault()
            return os.pread(fh, size, offset)

        def write(self, path, data, offset, fh):
            fault()
            return os.pwrite(fh, data, offset)

        def truncate(self, path, length, fh=None):
            os.truncate(self._real(path), length)

        def unlink(self, path):
            os.unlink(self._real(path))

        def release(self, path, fh):
            os.close(fh)

        def flush(self, path, fh):
            return 0

        def fsync(self, path, datasync, fh):
            return 0

    # direct_io: every read and write reaches this process (no page cache in between)
    FUSE(Passthrough(), mount, foreground=True, nothreads=False, direct_io=True)


class FaultyFS:
    def __init__(self, backing: str, mount: str, control_dir: str):
        self.mount = mount
        self._mode = os.path.join(control_dir, "mode")
        self.set("ok")
        os.makedirs(mount, exist_ok=True)
        self._proc = SPAWN.Process(target=_serve, args=(backing, mount, self._mode), daemon=True)
        self._proc.start()
        deadline = time.monotonic() + MOUNT_WAIT_S
        while not os.path.ismount(mount):
            if time.monotonic() > deadline or not self._proc.is_alive():
                self.close()
                raise RuntimeError(f"the FUSE filesystem did not mount at {mount}")
            time.sleep(0.02)

    def set(self, mode: str) -> None:
        with open(self._mode + ".new", "w") as f:
            f.write(mode)
        os.replace(self._mode + ".new", self._mode)

    def close(self) -> None:
        self.set("ok")
        if os.path.ismount(self.mount):
            subprocess.run(["fusermount", "-u", "-z", self.mount], check=False,
                           capture_output=True)
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(10)
