"""SGLang's real ``UnifiedRadixCache`` prefetch path over tiercache: a producer tree backs a
prefix up to L3 (``write_backup_storage`` -> ``batch_set_v1``), a fresh consumer tree finds
nothing in host memory, ``prefetch_from_storage`` brings the prefix in (``batch_exists``,
``batch_get_v1``, ACKs), and ``match_prefix`` then reports the host hit; the consumer's host
pages hold the producer's bytes exactly. Built with SGLang's own unified-radix-cache test kit
(its fixtures build the tree, pools and allocator on CPU)."""

from __future__ import annotations

from sglang_env import require_sglang

require_sglang()

import ctypes  # noqa: E402
import json  # noqa: E402
import unittest  # noqa: E402
import uuid  # noqa: E402
from array import array  # noqa: E402
from unittest import mock  # noqa: E402

import numpy as np  # noqa: E402

from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: E402
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as assembler  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler  # noqa: E402
from sglang.test.kits.unified_radix_cache.config import CacheConfig  # noqa: E402
from sglang.test.kits.unified_radix_cache import fixtures  # noqa: E402
from sglang.test.kits.unified_radix_cache.fixtures import (  # noqa: E402
    build_fixture, drop_hicache_atexit_pin, match_prefix, node_host_value,
)
from sglang.test.kits.unified_radix_cache.storage import (  # noqa: E402
    UnifiedRadixCacheStorageFixtures,
)

from tiercache.config import Config, ExporterConfig, KVGeometry, RegionConfig  # noqa: E402
from tiercache.service.process import CoordinatorProcess  # noqa: E402

CFG = CacheConfig(page_size=16, num_layers=2, kv_size=512, max_context_len=512)


class TestRadixCachePrefetch(UnifiedRadixCacheStorageFixtures, unittest.TestCase):
    cfg = CFG
    ps = CFG.page_size

    def setUp(self):
        import shutil
        import tempfile
        from pathlib import Path

        self._rid = 0
        tmp = Path(tempfile.mkdtemp(prefix="tiercache-radix-"))
        self.addCleanup(shutil.rmtree, tmp, True)  # after the coordinator's cleanup (LIFO)
        blob = CFG.num_layers * CFG.page_size * CFG.head_num * CFG.head_dim * 2
        name = f"test-{uuid.uuid4().hex[:8]}"
        config = Config(name=name, world_size=1, kv=KVGeometry(page_bytes=(blob, blob),
                                                                block_tokens=CFG.page_size),
                        region=RegionConfig(capacity_bytes=None, num_blocks=64,
                                            prefault_threads=1, attachments_per_rank=8),
                        exporter=ExporterConfig(port=0), control_socket=str(tmp / "c.sock"))
        self.coordinator = CoordinatorProcess(config, workdir=tmp / "coord")
        self.addCleanup(self.coordinator.cleanup)
        # the kit asks for an accelerator; its trees, pools and allocator run on the CPU
        patcher = mock.patch.object(fixtures, "get_device", return_value="cpu")
        patcher.start()
        self.addCleanup(patcher.stop)
        # ... and host pools unpinned (pinning needs CUDA), as the kit's own CPU tests do
        original = assembler.get_mha_host_pool_cls

        def unpinned(device_pool):
            cls = original(device_pool)
            return lambda *args, **kwargs: cls(*args, **{**kwargs, "pin_memory": False})

        patcher = mock.patch.object(assembler, "get_mha_host_pool_cls", side_effect=unpinned)
        patcher.start()
        self.addCleanup(patcher.stop)
        override = get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1)
        override.__enter__()
        self.addCleanup(override.__exit__, None, None, None)

    def _tiercache_hicache(self, cache, host_memory_mode: str = "cache"):
        extra = {"backend_name": "tiercache", "module_path": "tiercache.sglang",
                 "class_name": "TierCacheHiCacheStorage", "interface_v1": 1,
                 "tiercache_config": str(self.coordinator.config_path),
                 "prefetch_threshold": 1}
        server_args = ServerArgs(
            model_path="dummy", page_size=CFG.page_size, hicache_io_backend="kernel",
            hicache_write_policy="write_through", hicache_storage_backend="dynamic",
            hicache_storage_backend_extra_config=json.dumps(extra),
            hicache_storage_prefetch_policy="wait_complete",
            hicache_host_memory_mode=host_memory_mode)
        set_global_server_args_for_scheduler(server_args)
        cache.init_hicache(server_args, cache.cache_init_params)
        self.addCleanup(drop_hicache_atexit_pin, cache)
        self.addCleanup(cache.release_host_resources)
        cache.write_through_threshold = 1 << 30
        cache.load_back_threshold = 0
        controller = cache.cache_controller
        controller.prefetch_capacity_limit = max(controller.prefetch_capacity_limit,
                                                 controller.mem_pool_host.size)
        self.addCleanup(controller.detach_storage_backend)

    def _host_pages(self, cache, seq):
        """Bytes of every host page on the matched path of ``seq``, in order."""
        host = cache.cache_controller.storage_host_pool
        out = []
        for node in self._path_chain(cache, match_prefix(cache, seq).last_host_node):
            indices = node_host_value(cache, node, ComponentType.FULL)
            for p in range(len(indices) // self.ps):
                ptrs, sizes = host.get_page_buffer_meta(indices[p * self.ps:(p + 1) * self.ps])
                out.append(b"".join(ctypes.string_at(a, n) for a, n in zip(ptrs, sizes)))
        return out

    def test_prefetch_from_storage_then_match_prefix_reports_the_host_hit(self):
        self._produce_then_consume("cache")

    def test_buffer_only_host_memory_stages_the_prefetch_for_admission(self):
        """--hicache-host-memory-mode buffer_only (docs/sglang.md: the mode to run with):
        the consumer's host pool is a staging buffer and the prefetched span is staged for
        admission (admitting it copies host to device: CUDA only, not run here)."""
        self._produce_then_consume("buffer_only")

    def _produce_then_consume(self, consumer_mode: str):
        seq = self._make_seq(1000, 6)
        prod, prod_alloc, prod_rtp = build_fixture(self.cfg)
        self._tiercache_hicache(prod)
        self._insert(prod, prod_alloc, prod_rtp, seq)
        leaf = match_prefix(prod, seq).last_device_node
        self._simulate_backup(prod, leaf)  # D->H is GPU-only: give the host pages bytes
        host = prod.cache_controller.storage_host_pool
        rng = np.random.default_rng(7)
        for node in self._path_chain(prod, leaf):
            indices = node_host_value(prod, node, ComponentType.FULL)
            for p in range(len(indices) // self.ps):
                ptrs, sizes = host.get_page_buffer_meta(indices[p * self.ps:(p + 1) * self.ps])
                for a, n in zip(ptrs, sizes):
                    data = rng.integers(0, 256, n, dtype=np.uint8)
                    ctypes.memmove(a, data.ctypes.data, n)
        expected = self._host_pages(prod, seq)
        self._write_path_to_l3(prod, leaf)
        self._flush_l3_backups(prod)

        cons, _, _ = build_fixture(self.cfg)
        self._tiercache_hicache(cons, consumer_mode)
        before = match_prefix(cons, seq)
        self.assertEqual(before.host_hit_length, 0)
        request = CacheRequestHandle("consumer", 0)
        cons.prefetch_from_storage(request, cons.root_node_handle(), array("q", seq), None, None)
        counters = cons.cache_controller.storage_backend.counters
        if consumer_mode == "buffer_only":
            self._pump_hicache_until(cons, lambda: cons.check_prefetch_progress(request),
                                     "the prefetch completes")
            self.assertTrue(cons.buffer_pipeline.has_staged(request))
            self.assertEqual(counters.snapshot()["loaded_pages"], 6)
            return
        self._run_prefetch_to_completion(cons, request)
        after = match_prefix(cons, seq)
        self.assertEqual(after.host_hit_length, len(seq))
        self.assertEqual(self._host_pages(cons, seq), expected)
        self.assertEqual(counters.snapshot()["loaded_pages"], 6)  # through tiercache, the only L3
