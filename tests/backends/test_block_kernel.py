"""The block pack/unpack kernels, byte-exact against the numpy reference.

On CPU they run under Triton's interpreter (``TRITON_INTERPRET=1`` makes ``@triton.jit``
kernels execute in numpy over real host addresses), in a subprocess because the
interpreter is chosen when triton is imported; without triton in this environment the
test is skipped. On a GPU the same cases run on CUDA (``-m gpu``). The cases and the
executor: tests/support/block_kernels.py and block_reference.py.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

HAVE_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(
    not HAVE_TRITON, reason="triton is not installed here (it is in the 'gpu' extras, not "
    "'test'); the kernels' interpreter run needs it")
ROOT = Path(__file__).resolve().parents[2]
NUM_RANDOM_CASES = 150


@needs_triton
def test_kernels_match_the_reference_under_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests" / "support")]))
    done = subprocess.run([sys.executable, "-m", "block_kernels", str(NUM_RANDOM_CASES), "cpu"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = done.stdout.splitlines()
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    assert sum(line.startswith("ok ") for line in lines) == NUM_RANDOM_CASES + 10
    assert any("access=8" in line for line in lines)  # narrower accesses were exercised too
    assert any("access=16" in line for line in lines)


@needs_triton
def test_launch_refuses_a_misaligned_slot_and_bad_settings():
    from tiercache.backends.staged.block_kernel import BlockKernel
    from tiercache.backends.staged.block_layout import BlockStaging
    from tiercache.errors import BackendError
    from tiercache.pages import PageArray
    from tiercache.planning.planner import TransferPlanner

    planner = TransferPlanner([PageArray(1 << 40, 4, 4096, 4096)],
                              [PageArray(1 << 41, 4, 4096, 4096)], 1)
    staging = BlockStaging.of_geometry(planner.geometry, 1 << 20)
    with pytest.raises(BackendError, match="num_warps = 3"):
        BlockKernel(staging, "cpu", num_warps=3)
    with pytest.raises(BackendError, match="max_programs = 0"):
        BlockKernel(staging, "cpu", max_programs=0)
    with pytest.raises(BackendError, match=r"slot_base = 0x10080: must be a multiple of 256"):
        BlockKernel(staging, "cpu").pack(1 << 30, 1, 0, 1, 0x10080)


@needs_triton
@pytest.mark.parametrize("store", [True, False])
def test_aligned_pages_compile_to_16_byte_accesses_for_sm90(store):
    """Compiled for an H100 without one (Triton ships ptxas): the page copy must be
    ``v2.b64`` loads and stores, the table reads scalar."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tiercache.backends.staged.block_kernel import _move_pages

    ints = {"pairs": "i64", "pair_stride": "i32", "first": "i32", "count": "i32",
            "slot_base": "i64", "tensors": "i64", "tensor_stride": "i32", "groups": "i64",
            "num_groups": "i32"}
    meta = {"STORE": store, "DTYPE": tl.int64, "ELEM_BYTES": 8, "ALIGN_BYTES": 16, "BLOCK": 2048}
    source = ASTSource(_move_pages, {**ints, **{k: "constexpr" for k in meta}}, constexprs=meta)
    ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4}).asm["ptx"]
    assert "ld.global.v2.b64" in ptx and "st.global.v2.b64" in ptx
    assert "st.global.b64" not in ptx  # every page store is 16 bytes wide


@pytest.mark.gpu
@needs_triton
def test_kernels_match_the_reference_on_cuda():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from block_kernels import cases, run_kernel_case

    for _, seed, case in cases(NUM_RANDOM_CASES):
        run_kernel_case(case, seed, "cuda")
    torch.cuda.synchronize()
