"""The engine's workers: one ``RankChannel`` per rank, spawned, replaced and closed together."""

from __future__ import annotations

from collections.abc import Sequence
from multiprocessing.connection import wait as wait_connections

from tiercache.config import Config
from tiercache.errors import WorkerError
from tiercache.tools.demo.channel import RankChannel
from tiercache.tools.demo.rank import RankOptions
from tiercache.tools.demo.wire import Command, Report


class RankPool:
    """``config.world_size`` worker processes; a rank's slot is empty until spawned."""

    def __init__(self, config: Config, options: RankOptions):
        self.config = config
        self.options = options
        self._channels: list[RankChannel | None] = [None] * config.world_size

    def spawn(self, rank: int, timeout_s: float) -> Report:
        """Start ``rank``'s worker (SIGKILLing and reaping one still there); its ATTACHED."""
        old = self._channels[rank]
        if old is not None:
            old.kill()
        channel = self._channels[rank] = RankChannel(self.config, rank, self.options)
        return channel.wait_attached(timeout_s)

    def spawn_all(self, timeout_s: float) -> None:
        """Start every rank at once (they import and attach in parallel)."""
        for rank in range(self.config.world_size):
            self._channels[rank] = RankChannel(self.config, rank, self.options)
        for channel in self._live():
            channel.wait_attached(timeout_s)

    def channel(self, rank: int) -> RankChannel:
        channel = self._channels[rank]
        if channel is None:
            raise WorkerError(f"rank {rank} has no worker")
        return channel

    def _live(self) -> list[RankChannel]:
        return [c for c in self._channels if c is not None]

    def pids(self) -> list[int]:
        return [c.pid if c is not None else 0 for c in self._channels]

    def send(self, ranks: Sequence[int], command: Command) -> list[int]:
        """Send to each of ``ranks``; returns the ranks whose worker is gone."""
        return [rank for rank in ranks if not self.channel(rank).send(command)]

    def broadcast(self, command: Command) -> list[int]:
        return self.send(range(self.config.world_size), command)

    def reports(self, timeout_s: float) -> list[Report]:
        """What the workers sent, waiting up to ``timeout_s`` for the first of it."""
        conns = [c.connection for c in self._live() if c.open]
        if conns:
            wait_connections(conns, timeout_s)
        return [report for channel in self._live() for report in channel.receive()]

    def outstanding(self) -> dict[int, list[int]]:
        """Per rank with a live pipe: job ids sent and not reported yet (if any)."""
        return {c.rank: sorted(c.outstanding) for c in self._live() if c.open and c.outstanding}

    def forget_outstanding(self, rank: int) -> None:
        """``rank``'s worker is gone: nobody will report its jobs."""
        channel = self._channels[rank]
        if channel is not None:
            channel.outstanding.clear()

    def close(self) -> list[Report]:
        """Drain and close every worker; the first failure is raised after all were closed."""
        reports: list[Report] = []
        errors: list[WorkerError] = []
        for rank, channel in enumerate(self._channels):
            if channel is None:
                continue
            try:
                reports += channel.close()
            except WorkerError as e:
                errors.append(e)
            self._channels[rank] = None
        if errors:
            raise errors[0]
        return reports
