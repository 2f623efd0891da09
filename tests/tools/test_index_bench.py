"""The index benchmarks run end to end at toy sizes (numbers are not asserted)."""

from __future__ import annotations

from tiercache.tools.index_bench import bench_control_plane, bench_index


def test_index_benchmark_runs_both_policies():
    for policy in ("lru", "arc"):
        result = bench_index(policy, num_blocks=256, min_duration_s=0.01)
        assert result.policy == policy and result.keys_per_s > 0


def test_control_plane_benchmark_cleans_up():
    result = bench_control_plane(num_clients=2, num_calls=20, interval_s=1e-4)
    assert result.num_calls == 40
    assert 0 < result.p50_s <= result.p99_s <= result.max_s
