"""A Python script run with a small private ``/dev/shm``: a tmpfs of its own, mounted in a
mount namespace of its own (``unshare``, root), so that filling it touches no other test's
or user's shared memory and nothing of it outlives the run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest


def run_on_small_dev_shm(script: str, tmp_path: Path, size: str = "8m") -> dict[str, Any]:
    """Run ``script`` (Python source) with a ``size`` tmpfs as ``/dev/shm``; the JSON
    object its last stdout line prints. Skips where a private tmpfs cannot be mounted; fails
    on any other exit than 0 (a SIGBUS would be -7), with the script's stderr."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare for a private /dev/shm")
    path = tmp_path / "child.py"
    path.write_text(script)
    run = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c",
         f"mount -t tmpfs -o size={size},mode=1777 tmpfs /dev/shm && exec {sys.executable} {path}"],
        capture_output=True, text=True, env={**os.environ})
    if run.returncode != 0 and "mount" in run.stderr and "Traceback" not in run.stderr:
        pytest.skip(f"cannot mount a private tmpfs here: {run.stderr.strip()}")
    assert run.returncode == 0, run.stderr
    out: dict[str, Any] = json.loads(run.stdout.splitlines()[-1])
    out["stderr"] = run.stderr
    return out
