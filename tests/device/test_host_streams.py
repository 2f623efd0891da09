"""Host streams and events keep torch.cuda's semantics (what the handlers rely on)."""

from __future__ import annotations

import threading

import pytest

from tiercache.errors import BackendError
from tiercache.device.host_streams import HostStreams


@pytest.fixture
def streams():
    platform = HostStreams()
    yield platform
    platform.close()


def test_event_lifecycle_and_timing(streams):
    stream, start, end = streams.new_stream(), streams.new_timing_event(), streams.new_timing_event()
    assert end.query()  # never recorded: nothing to wait for (CUDA semantics)
    gate = threading.Event()
    start.record(stream)
    stream.launch(lambda: gate.wait(timeout=60))
    end.record(stream)
    assert not end.query()
    gate.set()
    end.synchronize()
    assert end.query() and start.elapsed_time(end) >= 0.0


def test_wait_event_orders_streams_and_unrecorded_events_do_not_block(streams):
    first, second = streams.new_stream(), streams.new_stream()
    order: list[str] = []
    gate = threading.Event()
    marker, done = streams.new_timing_event(), streams.new_timing_event()
    second.wait_event(streams.new_timing_event())  # never recorded: no wait
    first.launch(lambda: gate.wait(timeout=60))
    first.launch(lambda: order.append("first"))
    marker.record(first)
    second.wait_event(marker)
    second.launch(lambda: order.append("second"))
    done.record(second)
    gate.set()
    done.synchronize()
    assert order == ["first", "second"]


def test_wait_stream_follows_the_compute_stream(streams):
    compute, transfer = streams.current_stream(), streams.new_stream()
    gate, seen = threading.Event(), []
    compute.launch(lambda: gate.wait(timeout=60))
    compute.launch(lambda: seen.append("compute"))
    transfer.wait_stream(compute)
    transfer.launch(lambda: seen.append("transfer"))
    gate.set()
    transfer.synchronize()
    assert seen == ["compute", "transfer"]


def test_a_failure_fails_the_next_event_only(streams):
    stream = streams.new_stream()
    failed, later = streams.new_timing_event(), streams.new_timing_event()

    def boom():
        raise OSError("on purpose")

    stream.launch(boom)
    failed.record(stream)
    with pytest.raises(BackendError, match="on purpose"):
        failed.synchronize()
    with pytest.raises(BackendError):
        failed.query()
    stream.launch(lambda: None)
    later.record(stream)
    later.synchronize()
    assert later.query()
    failed.record(stream)  # reused: the old failure is gone once the new record ran
    failed.synchronize()
    assert failed.query()


def test_close_runs_what_is_queued_then_refuses(streams):
    stream, ran = streams.new_stream(), []
    stream.launch(lambda: ran.append(1))
    streams.close()
    assert ran == [1]
    with pytest.raises(BackendError, match="closed"):
        stream.launch(lambda: None)


def test_events_of_another_platform_are_refused(streams):
    other = HostStreams()
    try:
        with pytest.raises(BackendError, match="same HostStreams"):
            streams.new_timing_event().record(other.new_stream())
    finally:
        other.close()
