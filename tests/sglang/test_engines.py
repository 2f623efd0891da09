"""SGLang engines in processes of their own on one coordinator: one backs a prefix up, another
prefetches it; TP=2 (two rank processes with a real gloo TP group, each its own shard); an
MLA model (one writer, every rank loads). Every loaded page is checked byte for byte."""

from __future__ import annotations

from sglang_env import require_sglang

require_sglang()

import pytest  # noqa: E402

from engine_proc import RemoteRank, call_all, start_all  # noqa: E402
from sglang_harness import ModelSpec, tokens_of  # noqa: E402

PAGE = 16


@pytest.fixture
def remote(tmp_path):
    """``start(config_path, dist=None, **kw)`` -> a RemoteRank; all closed after."""
    started = []

    def start(config_path, dist=None, **kw):
        rank = RemoteRank(str(config_path), dist, **kw)
        started.append(rank)
        return rank

    yield start
    for rank in started:
        rank.close()


def _tp_group(tmp_path, rank: int, world: int) -> dict:
    return {"init": f"file://{tmp_path}/tp-group", "rank": rank, "world": world}


def test_one_engine_backs_a_prefix_up_another_prefetches_it(coordinator, remote):
    a, b = start_all([remote(coordinator.config_path), remote(coordinator.config_path)])
    tokens = tokens_of(11, 5)
    assert a.call("backup", tokens) == len(tokens)
    loaded, wrong = b.call("prefetch", tokens + tokens_of(12, 1))
    assert loaded == len(tokens) and wrong == []
    assert b.call("counters")["stored_pages"] == 0


@pytest.mark.parametrize("world_size", [1, 2], ids=["one-rank-region", "rank-per-tp-rank"])
def test_tp2_each_rank_its_own_shard_and_a_page_is_whole_only_with_every_shard(
        start_coordinator, remote, tmp_path, world_size):
    model = ModelSpec(heads=4)
    coordinator = start_coordinator(spec=model, world_size=world_size, tp_size=2)
    ranks = start_all([remote(coordinator.config_path, _tp_group(tmp_path, r, 2), model=model,
                              tp_rank=r, tp_size=2) for r in range(2)])
    tokens = tokens_of(13, 4)
    assert call_all(ranks, "backup", tokens) == [len(tokens)] * 2
    assert call_all(ranks, "prefetch", tokens) == [(len(tokens), [])] * 2
    # rank 1 backs up only the first 2 pages of a new prefix: SGLang's MIN over the TP
    # group makes pages 3 and 4 misses for both ranks (rank 0 holds its shards of them)
    other = tokens_of(14, 4)
    assert ranks[0].call("backup", other) == 4 * PAGE
    assert ranks[1].call("backup", other[:2 * PAGE]) == 2 * PAGE
    assert call_all(ranks, "prefetch", other) == [(2 * PAGE, [])] * 2


def test_mla_one_writer_every_rank_loads(start_coordinator, remote, tmp_path):
    model = ModelSpec(name="tiny-mla", mla=True)
    coordinator = start_coordinator(spec=model)
    ranks = start_all([remote(coordinator.config_path, _tp_group(tmp_path, r, 2), model=model,
                              tp_rank=r, tp_size=2) for r in range(2)])
    tokens = tokens_of(15, 3)
    # SGLang skips the backup on rank 1 (not its storage writer) and ACKs it all the same
    assert call_all(ranks, "backup", tokens) == [len(tokens), 0]
    counters = call_all(ranks, "counters")
    assert counters[0]["stored_pages"] == 3 and counters[1]["stored_pages"] == 0
    assert call_all(ranks, "prefetch", tokens) == [(len(tokens), [])] * 2
