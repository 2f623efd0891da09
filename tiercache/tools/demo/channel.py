"""The scheduler's end of one rank: a spawned ``rank_main`` process and its pipe."""

from __future__ import annotations

import multiprocessing as mp
import time

from tiercache.config import Config
from tiercache.errors import WorkerError
from tiercache.tools.demo.rank import RankOptions, rank_main
from tiercache.tools.demo.wire import Command, Op, Report

CLOSE_TIMEOUT_S = 30.0


class RankChannel:
    """One worker process. ``outstanding`` holds the job ids sent and not yet reported."""

    def __init__(self, config: Config, rank: int, options: RankOptions):
        self.rank = rank
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # daemon: should the scheduler exit without close(), its workers are terminated
        # at exit instead of keeping it alive (they create nothing that outlives them).
        self.process = ctx.Process(target=rank_main, args=(config, rank, child, options),
                                   name=f"tiercache-demo-rank-{rank}", daemon=True)
        self.process.start()
        child.close()
        self.outstanding: set[int] = set()
        self.attached: Report | None = None
        self.open = True  # False once the pipe broke (the worker died or closed)

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    @property
    def connection(self):
        return self._conn

    @property
    def attachment(self) -> Report:
        """The worker's ATTACHED report; ``WorkerError`` while it has not attached."""
        if self.attached is None:
            raise WorkerError(f"rank {self.rank} (pid {self.pid}) has not attached")
        return self.attached

    def wait_attached(self, timeout_s: float) -> Report:
        """The worker's ATTACHED report; raises ``WorkerError`` if it failed or took too long."""
        deadline = time.monotonic() + timeout_s
        while self.attached is None:
            left = deadline - time.monotonic()
            if left <= 0 or not self._conn.poll(left):
                raise WorkerError(f"rank {self.rank} (pid {self.pid}) did not attach within "
                                  f"{timeout_s} s")
            self.receive()
            if not self.open:
                self.process.join(CLOSE_TIMEOUT_S)
                raise WorkerError(f"rank {self.rank} (pid {self.pid}) exited with code "
                                  f"{self.process.exitcode} before attaching")
        return self.attached

    def send(self, command: Command) -> bool:
        """False when the worker is gone (its jobs are then lost, see the tracker)."""
        if not self.open:
            return False
        try:
            self._conn.send_bytes(command.pack())
        except (BrokenPipeError, ConnectionResetError, EOFError):
            self.open = False
            return False
        if command.op in (Op.STORE, Op.LOAD):
            self.outstanding.add(command.job_id)
        return True

    def receive(self) -> list[Report]:
        """Every report waiting in the pipe (never blocks)."""
        reports = []
        while self.open and self._conn.poll(0):
            try:
                report = Report.unpack(self._conn.recv_bytes())
            except (EOFError, ConnectionResetError):
                self.open = False
                break
            if report.op is Op.ERROR:
                self.open = False
                raise WorkerError(f"rank {self.rank} (pid {self.pid}) failed: {report.message}")
            if report.op is Op.ATTACHED:
                self.attached = report
            if report.op is Op.DONE:
                self.outstanding.discard(report.job_id)
            reports.append(report)
        return reports

    def close(self, timeout_s: float = CLOSE_TIMEOUT_S) -> list[Report]:
        """Ask the worker to drain and exit; returns the reports it sent on the way out."""
        reports: list[Report] = []
        if self.send(Command(Op.CLOSE)):
            deadline = time.monotonic() + timeout_s
            while self.open and not any(r.op is Op.CLOSED for r in reports):
                left = deadline - time.monotonic()
                if left <= 0 or not self._conn.poll(left):
                    break
                reports += self.receive()
        self.process.join(max(0.0, timeout_s))
        if self.process.is_alive():
            self.kill()
            raise WorkerError(f"rank {self.rank} (pid {self.pid}) did not exit within "
                              f"{timeout_s} s of CLOSE; killed")
        self._conn.close()
        self.open = False
        return reports

    def kill(self) -> None:
        """SIGKILL (fault tests, or a worker that will not exit) and reap."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(CLOSE_TIMEOUT_S)
        self.open = False
        self._conn.close()
