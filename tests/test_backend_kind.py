"""One backend vocabulary: config names, stats codes and labels from ``BackendKind``, and
a ``ce_loop`` fallback visible end to end (stats block -> /metrics and ``tiercache status``).

The GPU side of the fallback (``ce.create`` on a driver without the batch API) is in
test_backends_gpu.py; here the kind is recorded as that worker records it, into a real
region's stats block, and read back by the real collector and the real CLI.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tiercache.backends import BACKEND_FACTORIES, resolve_kind
from tiercache.backend_kind import BackendKind
from tiercache.config import config_from_dict, config_to_toml, load_config
from tiercache.errors import BackendError, ConfigError
from tiercache.metrics.collector import TiercacheCollector
from tiercache.region.hostmem import process_start_ns
from tiercache.region.shared import SharedOffloadRegion
from tiercache.specs import Direction

from metrics_support import registry_of

G2C, C2G = Direction.GPU_TO_CPU, Direction.CPU_TO_GPU


def test_codes_of_existing_kinds_never_change():
    """Stats blocks store the code: a region written before CE_LOOP existed reads the same."""
    assert {k.label: int(k) for k in BackendKind} == {
        "none": 0, "ce": 1, "kernel": 2, "staged": 3, "cpu": 4, "ce_loop": 5, "auto": 6,
        "unknown": 255}


def test_a_stats_block_a_newer_worker_wrote_reads_as_unknown_never_a_traceback():
    """Codes this version does not know (a newer worker's backend or pin state in a shared
    region) are UNKNOWN, so status and /metrics read the region instead of failing."""
    import numpy as np

    from tiercache.region.stats import _BACKEND_G2C, _PIN_STATE, PinState, RankStats

    buffer = bytearray(4096)
    stats = RankStats(buffer, 0, rank=0)
    words = np.frombuffer(buffer, dtype="<u8")
    words[_PIN_STATE], words[_BACKEND_G2C] = 7, 9
    snap = stats.snapshot()
    assert snap.pin_state is PinState.UNKNOWN and snap.backends[0] is BackendKind.UNKNOWN
    assert not BackendKind.UNKNOWN.configurable
    with pytest.raises(ConfigError):
        BackendKind.parse("unknown")


def test_config_names_are_the_labels_and_round_trip(tmp_path):
    for kind in BackendKind:
        if not kind.configurable:
            continue
        config = config_from_dict({"transfer": {"backend": kind.label}})
        assert config.backend is kind
        path = tmp_path / f"{kind.label}.toml"
        path.write_text(config_to_toml(config))
        assert load_config(path).backend is kind
    with pytest.raises(ConfigError, match="transfer.backend = 'none': allowed 'auto', 'ce', "
                                          "'kernel', 'staged', 'cpu', 'ce_loop'$"):
        config_from_dict({"transfer": {"backend": "none"}})
    with pytest.raises(ConfigError, match="backend = 'ce-loop': allowed"):
        BackendKind.parse("ce-loop", "backend")
    assert BackendKind.parse(BackendKind.STAGED) is BackendKind.STAGED


def test_every_buildable_kind_has_a_factory_and_none_is_refused():
    assert set(BACKEND_FACTORIES) == {k for k in BackendKind if k.configurable}
    with pytest.raises(BackendError, match="backend 'none' cannot be built"):
        resolve_kind(BackendKind.NONE, "cpu")
    assert resolve_kind(BackendKind.AUTO, "cpu") is BackendKind.CPU
    with pytest.raises(BackendError, match="'ce_loop' needs the KV caches on a CUDA device"):
        resolve_kind(BackendKind.CE_LOOP, "cpu")


def test_ce_loop_fallback_shows_in_metrics_and_status(make_config):
    config = make_config()
    region = SharedOffloadRegion.create(config)
    try:
        stats = region.stats(0)
        stats.mark_attached(os.getpid(), process_start_ns(os.getpid()))
        stats.set_backend(G2C, BackendKind.CE_LOOP)  # what attach records for a ce fallback
        stats.set_backend(C2G, BackendKind.CE)
        stats.record_transfer(G2C, 1 << 20, 0.01, success=True)
        assert region.stats(0).snapshot().backends == (BackendKind.CE_LOOP, BackendKind.CE)

        registry = registry_of(TiercacheCollector(region))
        info = "tiercache_transfer_backend_info"
        assert registry.get_sample_value(
            info, {"rank": "0", "direction": "gpu_to_cpu", "backend": "ce_loop"}) == 1
        assert registry.get_sample_value(
            info, {"rank": "0", "direction": "cpu_to_gpu", "backend": "ce"}) == 1
        assert registry.get_sample_value(
            info, {"rank": "1", "direction": "gpu_to_cpu", "backend": "none"}) == 1

        status = subprocess.run([sys.executable, "-m", "tiercache", "status", "--name",
                                 config.name], capture_output=True, text=True)
        assert status.returncode == 0, status.stderr
        rank0 = next(line for line in status.stdout.splitlines() if "rank 0:" in line)
        assert "gpu_to_cpu 1.00 MiB in 1 ok/0 failed (ce_loop)" in rank0
        assert "cpu_to_gpu 0 B in 0 ok/0 failed (ce)" in rank0
    finally:
        region.close()


def test_zero_copy_is_given_to_a_backend_only_over_registered_host_rows():
    """The kernel of a zero-copy transfer dereferences the host rows: over a slice that is
    not page-locked and mapped it would fault (losing the CUDA context), so the bound a
    backend gets is 0 there, whatever the config says."""
    from dataclasses import replace

    from tiercache.backends.base import BackendContext
    from tiercache.pages import PageArray
    from tiercache.specs import Direction

    pages = (PageArray(1 << 20, 4, 4096, 4096),)
    pinned = BackendContext(Direction.CPU_TO_GPU, pages, pages, "cuda:0", True, None,
                            zero_copy_bytes=2 << 20)
    assert pinned.zero_copy_limit == 2 << 20
    assert replace(pinned, host_registered=False).zero_copy_limit == 0
    assert replace(pinned, zero_copy_bytes=0).zero_copy_limit == 0
