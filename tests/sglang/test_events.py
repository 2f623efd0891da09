"""SGLang's pages on the node's KV event stream: a real ``tiercache serve`` with ``[events]``,
an SGLang rank (its real HiCache controller) backing pages up through tiercache, and a
subscriber decoding with SGLang's own ``KVEventBatch``. Every stored page must appear with
the hash SGLang itself publishes for it (its ``KVCacheEventRecorder`` over the same tokens)
and SGLang's name for host memory, again after the coordinator restarts."""

from __future__ import annotations

from sglang_env import require_sglang

require_sglang()

import time  # noqa: E402

import pytest  # noqa: E402
from sglang.srt.disaggregation.kv_events import BlockStored, StorageMedium  # noqa: E402

from e2e_support import metrics_url, sample, scrape  # noqa: E402
from event_support import free_port, stream_endpoints  # noqa: E402
from sglang_events import SGLangSubscriber, sglang_events  # noqa: E402
from sglang_harness import tokens_of  # noqa: E402
from tiercache.config import EventsConfig  # noqa: E402
from tiercache.service.process import CoordinatorProcess  # noqa: E402

FAST = {"tiercache_retry_s": 0.05, "tiercache_call_timeout_s": 1.0}


@pytest.fixture
def subscribers():
    made = []

    def make(coordinator) -> SGLangSubscriber:
        sub = SGLangSubscriber(*stream_endpoints(coordinator))
        made.append(sub)
        return sub

    yield make
    for sub in made:
        sub.close()


def _events(port: int = 0, replay: int = 0) -> EventsConfig:
    return EventsConfig(endpoint=f"tcp://127.0.0.1:{port}",
                        replay_endpoint=f"tcp://127.0.0.1:{replay}", batch_interval_s=0.02)


def _topic(rank) -> str:
    namespace = rank.backend.namespace
    return f"{namespace.model}@{namespace.digest[:8].hex()}"


def _want(rank, tokens) -> set[int]:
    """The hashes SGLang's own events carry for ``tokens``' pages in host memory."""
    events = sglang_events(tokens, rank.model.page_size, StorageMedium.CPU)
    assert all(e.medium == StorageMedium.CPU for e in events)
    return {h for e in events for h in e.block_hashes}


def _stored(sub, topic) -> set[int]:
    return {h for t, e in sub.events(BlockStored) if t == topic for h in e.block_hashes}


def test_every_stored_page_is_on_the_stream_with_the_hash_sglang_publishes(
        start_coordinator, make_rank, subscribers):
    coordinator = start_coordinator(events=_events())
    rank = make_rank(coordinator)
    sub = subscribers(coordinator)
    tokens = tokens_of(31, 16)  # the probe's 16 pages
    assert rank.backup(tokens) == len(tokens)
    want = _want(rank, tokens)
    assert len(want) == 16
    topic = _topic(rank)
    sub.until(lambda s: _stored(s, topic) == want)
    stored = [e for t, e in sub.events(BlockStored) if t == topic]
    assert len(stored) == 16  # once per page
    assert {e.medium for e in stored} == {StorageMedium.CPU.value}  # "CPU_PINNED"
    samples = scrape(metrics_url(coordinator))
    for reason in ("undescribed", "no_namespace", "unreadable"):
        assert sample(samples, "tiercache_events_unpublished_keys_total", reason=reason) == 0
    assert sample(samples, "tiercache_events_published_total", type="BlockStored",
                  medium="CPU_PINNED") == 16


def test_the_backend_describes_again_when_the_coordinator_restarts(
        start_coordinator, make_rank, subscribers):
    ports = free_port(), free_port()
    coordinator = start_coordinator(events=_events(*ports))
    rank = make_rank(coordinator, extra=FAST)
    before, after = tokens_of(32, 3), tokens_of(33, 2)
    assert rank.backup(before) == len(before)
    coordinator.kill()  # SIGKILL: its region stays, the next serve re-adopts it
    again = CoordinatorProcess(coordinator.config, coordinator.workdir / "again")
    try:
        sub = subscribers(again)
        done = 0
        deadline = time.monotonic() + 60
        while done != len(after) and time.monotonic() < deadline:  # the breaker, the reconnect
            done = rank.backup(after)
        assert done == len(after)
        topic = _topic(rank)
        # the reconnected session described the namespace again: what the region kept is
        # announced, and the new pages too
        sub.until(lambda s: _stored(s, topic) == _want(rank, before) | _want(rank, after))
    finally:
        again.cleanup()
