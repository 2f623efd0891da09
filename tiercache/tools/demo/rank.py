"""One rank of the demo engine: a spawned process that owns KV caches and a ``Worker``.

It attaches by rank (``tiercache.attach``), reports ``ATTACHED`` with its incarnation
(the rank's attach count), then serves the scheduler's commands (``tiercache.tools.demo.wire``):
a STORE first writes the blocks' pages (the "model" producing KV) and then stores
them; a LOAD clears the destination blocks, loads, and checks every loaded block
against what its key must hold. One ``DONE`` report per job, in finishing order.
On CUDA the fills and checks run on the compute stream, which every transfer waits
for; on the host they run before the transfer is submitted. The process exits when
told (CLOSE) or when the scheduler's end of the pipe closes; SIGINT is ignored so a
Ctrl-C in the terminal lets the scheduler drain and close its workers.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from dataclasses import dataclass

import numpy as np

from tiercache.errors import EngineDependencyError, SpecError

try:
    import torch
except ModuleNotFoundError as e:  # the demo's ranks are engine workers: they need torch
    if e.name != "torch":
        raise
    raise EngineDependencyError.torch_for("tiercache demo") from e

from tiercache.config import Config
from tiercache.device.host_streams import HostStream
from tiercache.transfer.handlers import TransferResult
from tiercache.specs import CPULoadStoreSpec, Direction, GPULoadStoreSpec, TransferSpec
from tiercache.tools.demo.content import BlockContent, GpuIds
from tiercache.tools.demo.wire import Command, Op, Report
from tiercache.transfer.worker import Worker, attach

log = logging.getLogger(__name__)

BUSY_POLL_S = 0.0005  # how often a worker with transfers in flight looks for results
STALL_LIMIT_S = 120.0  # a stalled compute stream lets go by itself after this


@dataclass(frozen=True)
class RankOptions:
    device: str  # "cpu" or "cuda" (rank r uses cuda:r)
    num_gpu_blocks: int
    backend: str | None = None  # None: the config's transfer.backend
    ready_timeout_s: float = 30.0


@dataclass(frozen=True)
class _Job:
    op: Op
    gpu_ids: GpuIds
    seeds: np.ndarray


class RankSession:
    """The worker side of one rank; driven by ``serve`` on the process's main thread."""

    def __init__(self, config: Config, rank: int, options: RankOptions):
        self.rank = rank
        on_gpu = options.device == "cuda"
        self.device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        else:
            torch.set_num_threads(1)  # ranks share the host's cores: no intra-op pools
        kv = config.kv
        self.caches = [torch.zeros(options.num_gpu_blocks, page, dtype=torch.uint8,
                                   device=self.device) for page in kv.page_bytes]
        self.content = BlockContent(kv.page_bytes, kv.block_size_factor, rank, self.device)
        self.factor = kv.block_size_factor
        self.worker: Worker = attach(config, rank, self.caches, backend=options.backend,
                                     ready_timeout_s=options.ready_timeout_s)
        self.incarnation = self.worker.incarnation
        self._jobs: dict[int, _Job] = {}
        self._gate: threading.Event | None = None

    def attached_report(self) -> Report:
        backends = self.worker.backends
        return Report(Op.ATTACHED, self.rank, os.getpid(), self.incarnation,
                      backends=(backends[Direction.GPU_TO_CPU], backends[Direction.CPU_TO_GPU]),
                      pin_state=self.worker.pin_state)

    # ---------------------------------------------------------------- loop
    def serve(self, conn) -> None:
        while True:
            if conn.poll(BUSY_POLL_S if self._jobs else None):
                try:
                    data = conn.recv_bytes()
                except EOFError:
                    return  # the scheduler is gone: close() drains and detaches
                command = Command.unpack(data, self.factor)
                if command.op is Op.CLOSE:
                    return
                for report in self.handle(command):
                    conn.send_bytes(report.pack())
            for result in self.worker.get_finished():
                conn.send_bytes(self.report(result).pack())

    def handle(self, command: Command) -> list[Report]:
        if command.op is Op.STALL:
            self._stall()
        elif command.op is Op.RELEASE:
            self._release()
        elif command.op is Op.BENCH:
            return [self._bench(command)]
        elif command.op in (Op.STORE, Op.LOAD):
            return self._submit(command)
        else:
            raise SpecError(f"rank {self.rank}: command op {command.op!r} is not one the "
                            "scheduler sends")
        return []

    def _submit(self, command: Command) -> list[Report]:
        gpu_ids = GpuIds(command.gpu_ids, self.device)
        transfer: TransferSpec
        if command.op is Op.STORE:
            self.content.fill(self.caches, gpu_ids, command.seeds)
            transfer = (GPULoadStoreSpec(command.gpu_ids), CPULoadStoreSpec(command.cpu_ids))
        else:
            self.content.clear(self.caches, gpu_ids)
            transfer = (CPULoadStoreSpec(command.cpu_ids), GPULoadStoreSpec(command.gpu_ids))
        try:
            self.worker.transfer_async(command.job_id, transfer)
        except SpecError as e:  # nothing was enqueued: the job failed here
            log.error("rank %d job %d refused: %s", self.rank, command.job_id, e)
            direction = Direction.GPU_TO_CPU if command.op is Op.STORE else Direction.CPU_TO_GPU
            return [Report(Op.DONE, self.rank, os.getpid(), self.incarnation, command.job_id,
                           direction, success=False, message=str(e))]
        self._jobs[command.job_id] = _Job(command.op, gpu_ids, command.seeds)
        return []

    def report(self, result: TransferResult) -> Report:
        """The DONE report of a finished transfer (a load is checked first)."""
        job = self._jobs.pop(result.job_id)
        mismatched = 0
        if job.op is Op.LOAD and result.success:
            mismatched = self.content.count_mismatches(self.caches, job.gpu_ids, job.seeds)
            if mismatched:
                log.error("rank %d job %d: %d of %d loaded blocks hold the wrong bytes",
                          self.rank, result.job_id, mismatched, len(job.seeds))
        return Report(Op.DONE, self.rank, os.getpid(), self.incarnation, result.job_id,
                      result.transfer_type, result.success, result.transfer_size,
                      result.transfer_time, len(job.seeds), mismatched)

    # ---------------------------------------------------------------- fault injection
    def _stall(self) -> None:
        streams = self.worker.handlers.streams
        stream = streams.current_stream() if streams is not None else None
        if self.device.type != "cpu" or not isinstance(stream, HostStream):
            raise SpecError(f"rank {self.rank}: STALL needs the cpu backend (host streams)")
        if self._gate is None:
            gate = self._gate = threading.Event()
            stream.launch(lambda: gate.wait(STALL_LIMIT_S))

    def _release(self) -> None:
        if self._gate is not None:
            self._gate.set()
            self._gate = None

    # ---------------------------------------------------------------- bandwidth
    def _bench(self, command: Command) -> Report:
        """``repetitions`` back-to-back transfers of one direction over the same blocks."""
        gpu_ids = GpuIds(command.gpu_ids, self.device)
        store = command.direction.stores
        transfer: TransferSpec
        if store:
            self.content.fill(self.caches, gpu_ids, command.seeds)
            transfer = (GPULoadStoreSpec(command.gpu_ids), CPULoadStoreSpec(command.cpu_ids))
        else:
            self.content.clear(self.caches, gpu_ids)
            transfer = (CPULoadStoreSpec(command.cpu_ids), GPULoadStoreSpec(command.gpu_ids))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        job_ids = [command.job_id + i for i in range(command.repetitions)]
        started = time.monotonic_ns()
        for job_id in job_ids:
            self.worker.transfer_async(job_id, transfer)
        self.worker.wait(job_ids)
        ended = time.monotonic_ns()
        results = self.worker.get_finished()
        mismatched = 0 if store else self.content.count_mismatches(self.caches, gpu_ids,
                                                                   command.seeds)
        return Report(Op.BENCH_DONE, self.rank, os.getpid(), self.incarnation, command.job_id,
                      command.direction, all(r.success for r in results) and
                      len(results) == len(job_ids),
                      sum(r.transfer_size for r in results if r.success),
                      sum(r.transfer_time for r in results), len(command.seeds), mismatched,
                      started, ended)

    def close(self) -> list[TransferResult]:
        self._release()
        return self.worker.close()


def rank_main(config: Config, rank: int, conn, options: RankOptions) -> None:
    """Spawned entry point of one rank."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        session = RankSession(config, rank, options)
    except Exception as e:
        conn.send_bytes(Report(Op.ERROR, rank, os.getpid(),
                               message=f"{type(e).__name__}: {e}").pack())
        raise SystemExit(1) from e
    try:
        conn.send_bytes(session.attached_report().pack())
        session.serve(conn)
    except Exception as e:
        conn.send_bytes(Report(Op.ERROR, rank, os.getpid(), session.incarnation,
                               message=f"{type(e).__name__}: {e}").pack())
        raise
    finally:
        leftovers = session.close()
    try:
        for result in leftovers:
            conn.send_bytes(session.report(result).pack())
        conn.send_bytes(Report(Op.CLOSED, rank, os.getpid(), session.incarnation).pack())
    except (BrokenPipeError, EOFError):  # the scheduler is gone: nobody is left to tell
        return
