"""``PoolPages``: page addresses learned once from SGLang's host pool, computed in numpy."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tiercache.errors import ArgumentError, LayoutMismatchError
from tiercache.sglang.pool_pages import PoolPages


@dataclass
class WarpedPool:
    """A pool whose pages are not where an affine rule puts them (no SGLang layout is like
    this; a future one might be): its last page sits one byte off."""

    page_size: int = 4
    size: int = 64

    def get_page_buffer_meta(self, indices: torch.Tensor):
        first = int(indices[0])
        shift = 1 if first == self.size - self.page_size else 0
        return [4096 + first * 100 + shift, (1 << 20) + first * 100], [400, 400]


def test_a_pool_whose_pages_are_not_affine_is_refused_at_attach():
    with pytest.raises(LayoutMismatchError, match="not where its first two predict"):
        PoolPages(WarpedPool())


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "layer_first"])
def test_addresses_equal_sglangs_own_for_any_pages(layout):
    try:
        from sglang_harness import ModelSpec, SGLangRank  # noqa: F401 (needs SGLang)
    except ImportError:
        pytest.skip("SGLang is installed only in .venv-sglang")
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import _mha_host_inputs
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    device = MHATokenToKVPool(size=256, page_size=16, dtype=torch.bfloat16, head_num=2,
                              head_dim=64, layer_num=3, device="cpu", enable_memory_saver=False)
    cls, info, kw = _mha_host_inputs(device)
    host = cls(info, 2.0, 0, 16, layout, pin_memory=False, **kw)
    pages = PoolPages(host)
    rng = np.random.default_rng(0)
    starts = rng.permutation(host.size // 16)[:9] * 16
    indices = torch.from_numpy(np.concatenate([np.arange(s, s + 16) for s in starts]))
    want = [host.get_page_buffer_meta(indices[p * 16:(p + 1) * 16])[0] for p in range(9)]
    assert pages.addresses(indices, 9).tolist() == want
    with pytest.raises(ArgumentError, match="outside the host pool"):
        pages.addresses(torch.arange(host.size, host.size + 16), 1)
