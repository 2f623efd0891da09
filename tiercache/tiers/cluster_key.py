"""The cluster's key: ``cluster.key_file``, shared by the nodes of a cluster and readable by
nobody else, signs and checks every pool object (``block_header.BlockMac``).

The file is judged on the descriptor it is read from (a symlink is followed, and what it
leads to is judged): a regular file owned by the user tiercache runs as, mode 0600 or
stricter, of ``MIN_KEY_BYTES`` to ``MAX_KEY_FILE_BYTES`` bytes (the bytes are the key, as
they are: ``head -c 32 /dev/urandom`` makes one). Opened non-blocking, so a FIFO under the
name never hangs the start.
"""

from __future__ import annotations

import os
import stat

from tiercache.errors import ConfigError
from tiercache.region.shm import describe
from tiercache.tiers.block_header import MIN_KEY_BYTES, BlockMac

MAX_KEY_FILE_BYTES = 4096
HOW_TO_MAKE = ("make one with `head -c 32 /dev/urandom > KEY && chmod 600 KEY`, copy it to "
               "every node of the cluster (owned by the user tiercache runs as) and set "
               "cluster.key_file = \"KEY\"")


def load_cluster_key(path: str) -> BlockMac:
    """The MAC of the key in ``path``; ``ConfigError`` (one line) when the file may not be
    trusted or holds no usable key."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except OSError as e:
        raise ConfigError(f"cluster.key_file = {path!r}: cannot open it ({e.strerror}); "
                          f"{HOW_TO_MAKE}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise ConfigError(f"cluster.key_file = {path!r} is {describe(st)}: it must be a "
                              "regular file of the user tiercache runs as with mode 0600, "
                              "which nobody else can read or replace")
        if not MIN_KEY_BYTES <= st.st_size <= MAX_KEY_FILE_BYTES:
            raise ConfigError(f"cluster.key_file = {path!r} holds {st.st_size} bytes; allowed "
                              f"{MIN_KEY_BYTES}..{MAX_KEY_FILE_BYTES} ({HOW_TO_MAKE})")
        key = os.read(fd, MAX_KEY_FILE_BYTES + 1)
    finally:
        os.close(fd)
    if not MIN_KEY_BYTES <= len(key) <= MAX_KEY_FILE_BYTES:
        raise ConfigError(f"cluster.key_file = {path!r}: read {len(key)} bytes; allowed "
                          f"{MIN_KEY_BYTES}..{MAX_KEY_FILE_BYTES}")
    return BlockMac(key)
