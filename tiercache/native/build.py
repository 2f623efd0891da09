"""The native build step: compile the C sources (``src/``) into one shared library.

The only module of the package that runs a compiler. ``build`` compiles every ``.c`` file
of a source directory together (its ``.h`` files included by them) with ``$CC`` (else
``cc``) into a per-user cache, once per content of the directory's sources and the
flags, and returns the shared library's path; ``tiercache.native.library`` binds it. A
missing compiler or a failed build is a ``BackendError`` naming the compiler's message;
nothing falls back.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from tiercache.errors import BackendError

SOURCES = Path(__file__).with_name("src")
FLAGS = ("-O2", "-shared", "-fPIC", "-pthread")
LIBRARY_STEM = "tiercache-native"


def cache_dir() -> Path:
    """Where built libraries live: ``$TIERCACHE_CACHE_DIR``, else ``$XDG_CACHE_HOME`` or
    ``~/.cache``, then ``tiercache/native``."""
    root = os.environ.get("TIERCACHE_CACHE_DIR")
    if root:
        return Path(root) / "native"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tiercache" / "native"


def _digest(files: list[Path]) -> str:
    """What a build depends on: each source's name and content, and the flags."""
    h = hashlib.sha256(" ".join(FLAGS).encode())
    for path in files:
        h.update(b"\0" + path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def build(sources: Path = SOURCES, directory: Path | None = None) -> Path:
    """The shared library of the ``.c`` files in ``sources``, compiled once per content
    (atomic rename, so concurrent builders never see half a file)."""
    units = sorted(sources.glob("*.c"))
    if not units:
        raise BackendError(f"no C sources in {sources}")
    directory = directory or cache_dir()
    target = directory / f"{LIBRARY_STEM}-{_digest(sorted(units + list(sources.glob('*.h'))))}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise BackendError(f"the staged backend's chunk loop needs a C compiler: {compiler!r} "
                           "not found (install gcc or set CC; or configure transfer.backend = "
                           "'ce', which needs none)")
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        done = subprocess.run([compiler, *FLAGS, "-o", tmp, *map(str, units)],
                              capture_output=True, text=True)
        if done.returncode:
            names = ", ".join(unit.name for unit in units)
            raise BackendError(f"building {names} with {compiler} failed "
                               f"(exit {done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target
