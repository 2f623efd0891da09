"""The accepted gpu_caches forms become the right page addresses, or a clear refusal."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tiercache.errors import ArgumentError
from tiercache.region.shared import SharedOffloadRegion
from tiercache.transfer.kv_caches import device_of, page_arrays_of, slice_tensors, split_kv
from tiercache.pages import PageArray


def test_kv_halves_padding_and_cross_layer_addresses():
    kv = torch.zeros(2, 8, 4, 16, dtype=torch.bfloat16)  # (2, blocks, tokens, dim): 128 B pages
    k, v = page_arrays_of(split_kv([kv]), (128, 128))
    assert (k.base_address, v.base_address) == (kv.data_ptr(), kv.data_ptr() + 8 * 128)
    assert k.block_stride_bytes == v.block_stride_bytes == 128

    padded = torch.zeros(8, 192, dtype=torch.uint8)[:, :160]  # 160 real bytes, stride 192
    (page,) = page_arrays_of([padded], (128,))  # the region copies 128: the rest is padding
    assert (page.block_stride_bytes, page.page_bytes) == (192, 128)

    cross = torch.zeros(8, 3, 64, dtype=torch.uint8)  # one tensor, whole block per page
    (whole,) = page_arrays_of(cross, (192,), pages_per_block=1)
    assert (whole.block_stride_bytes, whole.page_bytes) == (192, 192)

    explicit = PageArray(cross.data_ptr(), 8, 192, 192)
    assert page_arrays_of([explicit], (192,)) == (explicit,)


@pytest.mark.parametrize("caches, pages, message", [
    ([torch.zeros(8, 64, dtype=torch.uint8)] * 2, (64,), "2 KV tensors given"),
    ([torch.zeros(64, 8, dtype=torch.uint8).t()], (64,), "must be contiguous"),
    ([torch.zeros(8, 32, dtype=torch.uint8)], (64,), "32 bytes per block"),
    ([torch.zeros(8, 64).numpy()], (64,), "expected a torch.Tensor or a PageArray"),
    ([PageArray(4096, 8, 64, 32)], (64,), "page_bytes=64"),
])
def test_refusals_name_the_problem(caches, pages, message):
    with pytest.raises(ArgumentError, match=message):
        page_arrays_of(caches, pages)


def test_split_kv_needs_a_leading_two_and_devices_must_agree():
    with pytest.raises(ArgumentError, match=r"expects \(2, num_blocks"):
        split_kv([torch.zeros(3, 8, 16)])
    assert device_of([PageArray(4096, 1, 8, 8)]) is None
    assert device_of(torch.zeros(2, 2)).type == "cpu"


def test_slice_tensors_are_strided_over_the_rank_rows(make_config):
    with SharedOffloadRegion.create(make_config()) as region:
        views = slice_tensors(region, 1)
        layout = region.layout
        assert [v.shape[1] for v in views] == list(layout.cpu_page_bytes)
        views[1][5].fill_(7)
        row = region.rank_array(1)[5]
        off = layout.page_offsets[1]
        assert np.all(row[off:off + layout.cpu_page_bytes[1]] == 7)
        assert not row[:off].any() and not row[off + layout.cpu_page_bytes[1]:].any()
        assert not region.rank_array(0).any()
