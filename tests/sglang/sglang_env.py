"""Skip a test module unless the real SGLang distribution is installed (``.venv-sglang``).

``import sglang`` alone is not a test: pytest puts ``tests/`` on ``sys.path``, where this
directory (``tests/sglang``) is itself importable as a namespace package named ``sglang``.
The installed distribution's metadata decides. The torchvision stand-in
(``tests/sglang/stubs``) goes on ``sys.path`` first: SGLang's host-pool package imports
modules that import torchvision, and the real one needs a CUDA torch.
"""

from __future__ import annotations

import sys
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import pytest

SGLANG_VERSION = "0.5.23"
STUBS = str(Path(__file__).with_name("stubs"))


def add_stubs() -> None:
    if STUBS not in sys.path:
        sys.path.insert(0, STUBS)


def require_sglang() -> None:
    try:
        found = version("sglang")
    except PackageNotFoundError:
        pytest.skip("SGLang is installed only in .venv-sglang (make venv-sglang; "
                    "make test-sglang)", allow_module_level=True)
    if found != SGLANG_VERSION:
        pytest.fail(f"sglang {found} is installed; these tests are for sglang {SGLANG_VERSION} "
                    "(rebuild with make venv-sglang)", pytrace=False)
    add_stubs()
