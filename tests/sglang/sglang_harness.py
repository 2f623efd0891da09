"""One SGLang rank on CPU: SGLang's real device pool, host pool, allocator and
``HiCacheController`` with tiercache loaded by SGLang's own ``dynamic`` storage factory,
against a running ``tiercache serve``.

The "model" is a content rule: the bytes of a page's blob are derived from the token prefix
that ends at the page's end, the blob's index and the rank's shard (an MLA page is the same
on every rank), so any process can check a page another process stored. ``backup`` writes
the rule's bytes into the host pool's pages (what SGLang's device-to-host copy would have
put there) and runs the controller's backup (``write_storage`` -> ``batch_set_v1`` -> ACK);
``prefetch`` runs the controller's prefetch (``batch_exists`` with the TP-group MIN reduce
-> host allocation as the scheduler does it -> ``batch_get_v1`` -> ACKs) and checks every
loaded page's bytes against the rule through SGLang's own ``get_page_buffer_meta``.
"""

from __future__ import annotations

import ctypes
import hashlib
import threading
from dataclasses import dataclass, field
from pathlib import Path
from queue import Empty
from typing import Any

import numpy as np

from sglang_env import add_stubs

add_stubs()

import torch  # noqa: E402
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import (  # noqa: E402
    _mha_host_inputs,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

from tiercache.config import Config, ExporterConfig, KVGeometry, RegionConfig  # noqa: E402

WAIT_S = 30.0
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class ModelSpec:
    """A KV shape small enough for CPU tests (MHA, or MLA with ``kv_lora_rank``)."""

    name: str = "tiny-llama"
    layers: int = 2
    heads: int = 2  # KV heads of the whole model (split over TP)
    head_dim: int = 64
    dtype: str = "bfloat16"
    page_size: int = 16
    mla: bool = False
    kv_lora_rank: int = 48
    rope_dim: int = 16

    def blob_bytes(self, tp_size: int = 1) -> tuple[int, ...]:
        itemsize = DTYPES[self.dtype].itemsize
        if self.mla:
            return (self.layers * self.page_size * (self.kv_lora_rank + self.rope_dim)
                    * itemsize,)
        blob = self.layers * self.page_size * (self.heads // tp_size) * self.head_dim * itemsize
        return (blob, blob)

    def coordinator_config(self, name: str, socket: str, num_blocks: int = 64,
                           world_size: int = 1, tp_size: int = 1, **fields: Any) -> Config:
        """A region whose rows hold one rank's page (two tensors: K and V; MLA: one)."""
        blobs = self.blob_bytes(tp_size)
        pages = blobs if self.mla else (blobs[0], blobs[1])
        return Config(name=name, world_size=world_size,
                      kv=KVGeometry(page_bytes=pages, block_tokens=self.page_size),
                      region=RegionConfig(capacity_bytes=None, num_blocks=num_blocks,
                                          prefault_threads=1, attachments_per_rank=8),
                      exporter=ExporterConfig(port=0), control_socket=socket, **fields)


def page_content(model: str, tokens: tuple[int, ...], blob: int, shard: int, nbytes: int
                 ) -> np.ndarray:
    """The rule: bytes of ``blob`` of the page that ends at ``tokens[-1]``."""
    h = hashlib.blake2b(digest_size=8)
    h.update(f"{model}|{blob}|{shard}|".encode())
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    rng = np.random.default_rng(int.from_bytes(h.digest(), "little"))
    return rng.integers(0, 256, nbytes, dtype=np.uint8)


def tokens_of(seed: int, num_pages: int, page_size: int = 16) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(1, 30_000, num_pages * page_size)]


@dataclass
class SGLangRank:
    """One rank process's HiCache machinery (see the module docstring)."""

    config_path: str
    model: ModelSpec = field(default_factory=ModelSpec)
    tp_rank: int = 0
    tp_size: int = 1
    tp_group: Any = None
    layout: str = "page_first_direct"
    model_name: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    device_tokens: int = 512

    def __post_init__(self) -> None:
        get_parallel().override_permanently(attn_dcp_size=1, attn_dcp_rank=0,
                                            tp_rank=self.tp_rank, tp_size=self.tp_size,
                                            pp_rank=0, pp_size=1)
        m, dtype = self.model, DTYPES[self.model.dtype]
        if m.mla:
            self.device = MLATokenToKVPool(
                size=self.device_tokens, page_size=m.page_size, dtype=dtype,
                kv_lora_rank=m.kv_lora_rank, qk_rope_head_dim=m.rope_dim, layer_num=m.layers,
                device="cpu", enable_memory_saver=False)
            self.host = MLATokenToKVPoolHost(
                self.device.get_device_pool_infos()[0].buffer_info, 2.0, 0, m.page_size,
                self.layout, pin_memory=False, device_capacity_tokens=self.device_tokens,
                start_layer=self.device.start_layer, end_layer=self.device.end_layer,
                target_layer_num=m.layers, override_kv_cache_dim=self.device.kv_cache_dim)
        else:
            self.device = MHATokenToKVPool(
                size=self.device_tokens, page_size=m.page_size, dtype=dtype,
                head_num=m.heads // self.tp_size, head_dim=m.head_dim, layer_num=m.layers,
                device="cpu", enable_memory_saver=False)
            cls, info, kw = _mha_host_inputs(self.device)
            self.host = cls(info, 2.0, 0, m.page_size, self.layout, pin_memory=False, **kw)
        self.allocator = PagedTokenToKVPoolAllocator(self.device_tokens, m.page_size, dtype,
                                                     "cpu", self.device, need_sort=False)
        extra = {"backend_name": "tiercache", "module_path": "tiercache.sglang",
                 "class_name": "TierCacheHiCacheStorage", "interface_v1": 1,
                 "tiercache_config": str(self.config_path), **self.extra}
        self.controller = HiCacheController(
            self.allocator, self.host, page_size=m.page_size, tp_group=self.tp_group,
            load_cache_event=threading.Event(), io_backend="direct",
            storage_backend="dynamic", storage_backend_extra_config=extra,
            model_name=self.model_name or m.name, enable_storage_metrics=True)

    @property
    def shard(self) -> int:
        return 0 if self.model.mla else self.tp_rank

    @property
    def backend(self) -> Any:
        """tiercache's backend (under SGLang's failure injector when that is on)."""
        backend = self.controller.storage_backend
        return getattr(backend, "_backend", backend)

    # ------------------------------------------------------------------ pages
    def _pages(self, indices: torch.Tensor) -> list[tuple[list[int], list[int]]]:
        ps = self.model.page_size
        out = []
        for p in range(len(indices) // ps):
            ptrs, sizes = self.host.get_page_buffer_meta(indices[p * ps:(p + 1) * ps])
            out.append((list(ptrs), list(sizes)))
        return out

    def fill(self, indices: torch.Tensor, tokens: list[int]) -> None:
        ps = self.model.page_size
        for p, (ptrs, sizes) in enumerate(self._pages(indices)):
            prefix = tuple(tokens[:(p + 1) * ps])
            for blob, (ptr, n) in enumerate(zip(ptrs, sizes)):
                data = page_content(self.model_name or self.model.name, prefix, blob,
                                    self.shard, n)
                ctypes.memmove(ptr, data.ctypes.data, n)

    def wrong_pages(self, indices: torch.Tensor, tokens: list[int]) -> list[int]:
        """Pages whose bytes differ from the rule."""
        ps, wrong = self.model.page_size, []
        for p, (ptrs, sizes) in enumerate(self._pages(indices)):
            prefix = tuple(tokens[:(p + 1) * ps])
            for blob, (ptr, n) in enumerate(zip(ptrs, sizes)):
                want = page_content(self.model_name or self.model.name, prefix, blob,
                                    self.shard, n)
                if ctypes.string_at(ptr, n) != want.tobytes():
                    wrong.append(p)
                    break
        return wrong

    # ------------------------------------------------------------------ the controller
    def backup(self, tokens: list[int]) -> int:
        """Back ``tokens`` (whole pages) up through the controller; the ACK's tokens."""
        indices = self.host.alloc(len(tokens))
        assert indices is not None, "host pool full"
        try:
            self.fill(indices, tokens)
            hashes = get_storage_hash_str(tokens, None, page_size=self.model.page_size)
            self.controller.write_storage(indices, tokens, hash_value=hashes)
            op = self.controller.ack_backup_queue.get(timeout=WAIT_S)
            return int(op.completed_tokens)
        finally:
            self.host.free(indices)

    def query(self, tokens: list[int]) -> int:
        """The prefetch thread's TP-reduced hit count (tokens), nothing loaded."""
        op = self.controller.prefetch(f"q-{id(tokens)}", tokens)
        hit = self.controller.prefetch_hit_queue.get(timeout=WAIT_S)
        assert hit is op
        return int(hit.storage_hit_count)

    def prefetch(self, tokens: list[int], rid: str = "req",
                 before_load: Any = None) -> tuple[int, list[int]]:
        """(tokens loaded, pages whose bytes are wrong): query, allocate as the scheduler
        does, load, wait for the reduced ACKs, check every loaded page. ``before_load()``
        runs between the query and the load (the scheduler's time in between)."""
        op = self.controller.prefetch(rid, tokens)
        hit = self.controller.prefetch_hit_queue.get(timeout=WAIT_S)
        assert hit is op
        if before_load is not None:
            before_load()
        if hit.storage_hit_count == 0:
            return 0, []
        indices = self.host.alloc(hit.storage_hit_count)
        assert indices is not None, "host pool full"
        try:
            hit.host_indices = indices
            self.controller.prefetch_buffer.put(hit)
            loaded = 0
            while True:
                ack = self.controller.ack_prefetch_queue.get(timeout=WAIT_S)
                if ack.completed_req:
                    break
                loaded = ack.completed_tokens
            pages = loaded // self.model.page_size
            wrong = self.wrong_pages(indices[:pages * self.model.page_size], tokens)
            return loaded, wrong
        finally:
            self.host.free(indices)

    def counters(self) -> dict[str, int]:
        return self.backend.counters.snapshot()

    def drain(self) -> None:
        for q in (self.controller.ack_prefetch_queue,):
            try:
                while True:
                    q.get_nowait()
            except Empty:
                pass

    def close(self) -> None:
        self.controller.detach_storage_backend()


def config_file(tmp: Path, config: Config) -> Path:
    from tiercache.config import config_to_toml

    path = tmp / f"{config.name}.toml"
    path.write_text(config_to_toml(config))
    return path
