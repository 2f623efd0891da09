"""The native build step: compile ``chunk_loop.c`` (or ``host_copy.c``) with the system's C
compiler.

The only module of the package that runs a compiler. ``build`` compiles the source with
``$CC`` (else ``cc``) into a per-user cache, once per source content, and returns the
shared library's path; ``tiercache.native.library`` binds it. A missing compiler or a
failed build is a ``BackendError`` naming the compiler's message; nothing falls back.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tiercache.errors import BackendError

SOURCE = Path(__file__).with_name("chunk_loop.c")


def cache_dir() -> Path:
    """Where built libraries live: ``$TIERCACHE_CACHE_DIR``, else ``$XDG_CACHE_HOME`` or
    ``~/.cache``, then ``tiercache/native``."""
    root = os.environ.get("TIERCACHE_CACHE_DIR")
    if root:
        return Path(root) / "native"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tiercache" / "native"


def build(source: Path = SOURCE, directory: Path | None = None) -> Path:
    """The shared library of ``source``, compiled once per content (atomic rename, so
    concurrent builders never see half a file)."""
    text = source.read_bytes()
    directory = directory or cache_dir()
    target = directory / f"{source.stem}-{hashlib.sha256(text).hexdigest()[:16]}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise BackendError(f"building {source.name} needs a C compiler: {compiler!r} not "
                           "found (install gcc or set CC)" + (
                               "; or configure transfer.backend = 'ce', which needs none"
                               if source == SOURCE else ""))
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        done = subprocess.run([compiler, "-O2", "-shared", "-fPIC", "-pthread", "-o", tmp,
                               str(source)], capture_output=True, text=True)
        if done.returncode:
            raise BackendError(f"building {source.name} with {compiler} failed "
                               f"(exit {done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
