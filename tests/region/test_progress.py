"""``Progress``: the lines a long start-up step prints while it runs, driven by a fake clock
(no timed assertion), and the steps that report through it (fallocate, pre-fault, pin)."""

from __future__ import annotations

import ctypes
import mmap
import os
import threading

import numpy as np
import pytest

from tiercache.region.progress import GIB, Progress
from tiercache.region.hostmem import fallocate, prefault


class FakeClock:
    """Seconds that move only when told, or by ``step_s`` at every reading."""

    def __init__(self, step_s: float = 0.0):
        self.now, self.step_s = 0.0, step_s

    def __call__(self) -> float:
        self.now += self.step_s
        return self.now


def test_a_step_done_within_the_interval_prints_no_progress_line():
    lines: list[str] = []
    clock = FakeClock()
    progress = Progress("allocating /dev/shm/tiercache-x (fallocate)", 8 * GIB, lines.append,
                        clock=clock)
    for _ in range(8):
        clock.now += 0.2
        progress.advance(GIB)
    progress.tick()
    assert lines == [] and progress.done_bytes == 8 * GIB  # the step's own final line is all


def test_a_long_step_says_done_of_total_rate_and_eta_once_per_interval():
    lines: list[str] = []
    clock = FakeClock()
    progress = Progress("rank 0 pre-faulting its slice", 64 * GIB, lines.append, clock=clock)
    clock.now = 1.0
    progress.advance(4 * GIB)
    assert lines == []
    clock.now = 2.0
    progress.advance(4 * GIB)
    assert lines == ["rank 0 pre-faulting its slice: 8.0/64.0 GiB, 4.0 GiB/s, ETA 14 s"]
    clock.now = 3.5
    progress.advance(8 * GIB)  # 1.5 s since the last line: nothing yet
    progress.tick()
    assert len(lines) == 1
    clock.now = 4.0
    progress.tick()  # nothing finished since, and still a line: the step is alive
    assert lines[1] == "rank 0 pre-faulting its slice: 16.0/64.0 GiB, 4.0 GiB/s, ETA 12 s"


def test_before_anything_is_done_the_eta_is_unknown():
    lines: list[str] = []
    clock = FakeClock()
    progress = Progress("rank 1 pinning its slice", 64 * GIB, lines.append, clock=clock)
    clock.now = 2.5
    progress.tick()
    assert lines == ["rank 1 pinning its slice: 0.0/64.0 GiB, 0.0 GiB/s, "
                     "ETA unknown (nothing done yet)"]


def test_inside_with_the_ticker_reports_while_no_piece_finishes():
    """One ``cuMemHostRegister`` of 64 GiB is one piece: the ticker thread keeps the step
    visible meanwhile."""
    reported = threading.Event()
    lines: list[str] = []

    def report(line: str) -> None:
        lines.append(line)
        reported.set()

    with Progress("rank 0 pinning its slice", GIB, report, interval_s=0.01):
        assert reported.wait(30)  # no advance at all: the line came from the ticker
    assert lines[0].startswith("rank 0 pinning its slice: 0.0/1.0 GiB")


def test_fallocate_reports_each_piece(tmp_path):
    lines: list[str] = []
    progress = Progress("allocating", 1 << 20, lines.append, clock=FakeClock(step_s=2.0))
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fallocate(fd, 1 << 20, str(tmp_path / "f"), progress, piece_bytes=1 << 18)
        assert os.fstat(fd).st_size == 1 << 20
    finally:
        os.close(fd)
    assert progress.done_bytes == 1 << 20 and len(lines) == 4  # a line per piece here


@pytest.mark.parametrize("num_threads", [1, 3])
def test_prefault_reports_every_piece_of_every_thread(num_threads):
    size = 1 << 20
    mapping = mmap.mmap(-1, size)
    try:
        view = np.frombuffer(mapping, dtype=np.uint8)
        address = ctypes.addressof(ctypes.c_char.from_buffer(mapping))
        lines: list[str] = []
        progress = Progress("pre-faulting", size, lines.append, clock=FakeClock(step_s=2.0))
        step = size // 2
        prefault(address, view, [(0, step), (step, step)], num_threads, progress,
                 piece_bytes=1 << 16)
        assert progress.done_bytes == size and len(lines) == size >> 16
        del view
    finally:
        mapping.close()


def test_a_workers_prefault_and_pin_report_over_exactly_its_slice(make_config):
    from tiercache.config import PinningPolicy
    from tiercache.region.shared import SharedOffloadRegion
    from tiercache.region.stats import PinState

    class Registrar:  # page-locks nothing; tells progress what the driver would have done
        pinned_bytes = 0
        progress: Progress | None = None

        def pin(self, ranges: list[tuple[int, int]], progress: Progress) -> float:
            self.progress = progress
            for _, length in ranges:
                self.pinned_bytes += length
                progress.advance(length)
            return 0.0

        def unpin(self) -> float:
            return 0.0

    cfg = make_config()
    region = SharedOffloadRegion.create(cfg)
    worker = SharedOffloadRegion.attach(cfg.name, 1)
    try:
        lines: list[str] = []
        worker.prefault_slice(2, log_step=lines.append)
        [line] = lines  # done within 2 s: its final line only
        assert line.startswith("rank 1 pre-faulted its slice (") and "with 2 thread(s) in" in line
        registrar = Registrar()
        assert worker.pin(PinningPolicy.REQUIRED, registrar) is PinState.PINNED
        assert registrar.progress is not None
        assert registrar.progress.total_bytes == registrar.progress.done_bytes == \
            region.layout.slice_used_bytes
    finally:
        worker.close()
        region.close()
