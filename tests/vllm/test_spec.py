"""TierCacheOffloadingSpec built the way vLLM builds it: extra-config keys, the geometry
check at start (one error naming both sides), and the worker over CanonicalKVCaches."""

from __future__ import annotations

from vllm_env import require_vllm

require_vllm()

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor, GPULoadStoreSpec,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

from vllm_harness import offloading_config  # noqa: E402
from tiercache.errors import ConfigError, CoordinatorGoneError, LayoutMismatchError  # noqa: E402
from tiercache.errors import RegionNotFoundError  # noqa: E402
from tiercache.vllm.fenced_slot import FencedSlot  # noqa: E402
from tiercache.vllm.load_store_spec import TierCacheLoadStoreSpec  # noqa: E402
from tiercache.vllm.spec import TierCacheOffloadingSpec  # noqa: E402
from tiercache.vllm.worker import TransferFailedError  # noqa: E402


def unfenced(*slot_ids: int) -> TierCacheLoadStoreSpec:
    """A spec made by hand (region 0: not fenced), as no manager hands out."""
    return TierCacheLoadStoreSpec([FencedSlot(s, 0, 0) for s in slot_ids])


def test_vllms_factory_finds_the_spec_by_module_path(coordinator, tiny_model):
    spec = OffloadingSpecFactory.create_spec(offloading_config(coordinator, tiny_model))
    assert isinstance(spec, TierCacheOffloadingSpec)


@pytest.mark.parametrize("extra, message", [
    ({"tiercache_config": None}, "exactly one of 'tiercache_config'"),
    ({"tiercache_instance": "x"}, "exactly one of"),
    ({"tiercache_namespace_salt": 3}, "tiercache_namespace_salt = 3"),
    ({"tiercache_ready_timeout_s": -1}, "tiercache_ready_timeout_s = -1"),
    ({"canonical_layout": True}, "canonical_layout"),
])
def test_bad_extra_config_is_one_clear_error(coordinator, tiny_model, extra, message):
    config = offloading_config(coordinator, tiny_model)
    merged = {k: v for k, v in {**config.extra_config, **extra}.items() if v is not None}
    from dataclasses import replace

    config = replace(config, extra_config=merged,
                     canonical_layout=bool(merged.get("canonical_layout", False)))
    with pytest.raises(ConfigError, match=message):
        TierCacheOffloadingSpec(config)


def test_a_geometry_mismatch_names_both_sides_and_the_config_that_fits(start_coordinator,
                                                                       tiny_model):
    from dataclasses import replace

    wrong = start_coordinator(blocks_per_chunk=2)
    config = offloading_config(wrong, tiny_model)
    config = replace(config, worker_kv_bytes_per_block=3 * tiny_model.page_bytes)
    with pytest.raises(LayoutMismatchError) as e:
        TierCacheOffloadingSpec(config).get_manager()
    text = str(e.value)
    assert "GPU blocks per chunk: engine 1, region 2" in text
    assert f"KV bytes per block per rank: engine {3 * tiny_model.page_bytes}" in text
    assert "block_size_factor = 1" in text


def test_an_engine_started_before_its_coordinator_is_refused(coordinator, tiny_model):
    config = offloading_config(coordinator, tiny_model)
    coordinator.stop()
    with pytest.raises((RegionNotFoundError, CoordinatorGoneError),
                       match="tiercache serve|no region"):
        TierCacheOffloadingSpec(config).get_manager()


def canonical_caches(tiny_model, num_blocks=8, fill=True):
    """What vLLM's register_kv_caches hands over: one int8 (num_blocks, page) view per
    layer over the live KV (here each layer's own CPU tensor)."""
    layers = [torch.zeros((num_blocks, 2, 16, tiny_model.num_kv_heads, tiny_model.head_dim),
                          dtype=torch.float16) for _ in range(tiny_model.num_layers)]
    if fill:
        for i, layer in enumerate(layers):
            raw = layer.view(torch.uint8)
            raw.copy_(torch.randint(0, 255, raw.shape, dtype=torch.uint8,
                                    generator=torch.Generator().manual_seed(i)))
    page = tiny_model.page_bytes
    views = [t.view(torch.int8).reshape(num_blocks, page) for t in layers]
    caches = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(v, page) for v in views],
        group_data_refs=[[CanonicalKVCacheRef(i, page) for i in range(len(views))]])
    return caches, layers


def test_the_worker_stores_and_loads_canonical_kv_byte_for_byte(coordinator, tiny_model):
    spec = TierCacheOffloadingSpec(offloading_config(coordinator, tiny_model))
    caches, layers = canonical_caches(tiny_model)
    worker = spec.get_worker(caches)
    try:
        assert spec.get_worker(caches) is worker, "one worker per rank"
        worker.submit_store(1, GPULoadStoreSpec([2, 5], [2], [0]), unfenced(7, 3))
        worker.wait({1})
        (stored,) = worker.get_finished()
        assert (stored.job_id, stored.success) == (1, True)
        assert stored.transfer_size == 2 * tiny_model.num_layers * tiny_model.page_bytes
        worker.submit_load(2, unfenced(3, 7), GPULoadStoreSpec([0, 1], [2], [0]),
                           expedited=True)
        worker.wait({2})
        assert [r.job_id for r in worker.get_finished()] == [2]
        for layer in layers:
            raw = layer.view(torch.uint8).reshape(8, -1).numpy()
            assert np.array_equal(raw[0], raw[5]) and np.array_equal(raw[1], raw[2])
        assert worker.worker.stats.snapshot().pid  # the rank is attached and visible
    finally:
        worker.shutdown()


def test_a_worker_of_another_geometry_is_refused_naming_both_sides(coordinator, tiny_model):
    spec = TierCacheOffloadingSpec(offloading_config(coordinator, tiny_model))
    caches, _ = canonical_caches(tiny_model)
    caches.tensors.pop()
    caches.group_data_refs[0].pop()
    with pytest.raises(LayoutMismatchError, match=r"page bytes per tensor: engine 1 x \d+ B, "
                                                  r"region 2 x \d+ B"):
        spec.get_worker(caches)


class _FailedTransfers:
    """The transfer Worker's reporting side, with one failed store (a CUDA error cannot be
    produced on this host; the cpu backend does not fail)."""

    rank = 0

    def submit_store(self, job_id, gpu_spec, cpu_spec):
        return True

    def get_finished(self):
        from tiercache.specs import Direction
        from tiercache.transfer.handlers import TransferResult

        return [TransferResult(1, False, 4096, 0.0, Direction.GPU_TO_CPU)]


def test_a_failed_transfer_stops_the_engine_instead_of_reporting_success():
    from tiercache.vllm.worker import TierCacheWorker

    worker = TierCacheWorker(_FailedTransfers())
    worker.submit_store(1, GPULoadStoreSpec([0], [1], [0]), unfenced(3))
    with pytest.raises(TransferFailedError, match="store job 1 .*4096 bytes.*gpu_to_cpu.*rank 0"):
        worker.get_finished()


def test_a_slot_outside_the_region_is_refused_at_submission(coordinator, tiny_model):
    spec = TierCacheOffloadingSpec(offloading_config(coordinator, tiny_model))
    caches, _ = canonical_caches(tiny_model)
    worker = spec.get_worker(caches)
    try:
        with pytest.raises(Exception, match="out of range"):
            worker.submit_store(1, GPULoadStoreSpec([0], [1], [0]),
                                unfenced(10_000))
    finally:
        worker.shutdown()


def test_the_config_that_config_for_vllm_prints_fits_the_real_engine(model_dir, tmp_path,
                                                                     instance_name):
    """vLLM's own scheduler and worker connector start against a coordinator whose config
    is exactly what `tiercache config-for-vllm` printed for the model."""
    import subprocess
    import sys
    import tomllib
    from dataclasses import replace

    from tiercache.config import ExporterConfig, RegionConfig, config_from_dict
    from tiercache.service.process import CoordinatorProcess
    from vllm_harness import Engine, TinyModel

    out = subprocess.run([sys.executable, "-m", "tiercache", "config-for-vllm", str(model_dir),
                          "--name", instance_name, "--capacity", "1MiB",
                          "--socket", str(tmp_path / "c.sock"),
                          "--pinning", "allow_unpinned"],  # host tensors here: nothing to pin
                         capture_output=True, text=True, check=True)
    printed = config_from_dict(tomllib.loads(out.stdout))
    config = replace(printed, exporter=ExporterConfig(enabled=False),
                     region=replace(printed.region, prefault_threads=1))
    assert isinstance(config.region, RegionConfig)
    with CoordinatorProcess(config, workdir=tmp_path / "coord") as coordinator:
        engine = Engine.build(TinyModel(), model_dir, coordinator.config_path)
        try:
            assert engine.tiercache_worker.worker.rank == 0
            assert engine.manager.namespace.model == str(model_dir)
        finally:
            engine.shutdown()
