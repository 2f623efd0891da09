"""Skip a test module unless the real vLLM distribution is installed (``.venv-vllm``).

``import vllm`` alone is not a test: pytest puts ``tests/`` on ``sys.path``, and there this
directory (``tests/vllm``) is itself importable as a namespace package named ``vllm``.
The installed distribution's metadata is what decides.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

import pytest

VLLM_VERSION = "0.33.0"


def require_vllm() -> None:
    try:
        found = version("vllm")
    except PackageNotFoundError:
        pytest.skip("vLLM is installed only in .venv-vllm (make venv-vllm; make test-vllm)",
                    allow_module_level=True)
    if found != VLLM_VERSION:
        pytest.fail(f"vllm {found} is installed; these tests are for vllm {VLLM_VERSION} "
                    "(rebuild with make venv-vllm)", pytrace=False)
