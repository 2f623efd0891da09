"""A ``tiercache serve`` child process: started, awaited until it serves, stopped, and
cleaned up after (the demo runs its coordinator this way; tests do too)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tiercache.config import Config, config_to_toml
from tiercache.errors import ServiceError
from tiercache.service.logs import STEP_LOGGER

DEFAULT_START_TIMEOUT_S = 60.0
READY_MARKER = f"{STEP_LOGGER}: ready in "  # the step `serve` logs (text format) once it serves


class CoordinatorProcess:
    """A real ``python -m tiercache serve`` child; ``stop()`` sends SIGTERM and waits."""

    def __init__(self, config: Config, workdir: str | os.PathLike[str] | None = None,
                 timeout_s: float = DEFAULT_START_TIMEOUT_S):
        self.config = config
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if not workdir:
            self._tmp = tempfile.TemporaryDirectory(prefix="tiercache-coord-")
            workdir = self._tmp.name
        self.workdir = Path(workdir)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.config_path = self.workdir / f"{config.name}.toml"
        self.config_path.write_text(config_to_toml(config))
        self.log_path = self.workdir / f"{config.name}.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tiercache", "serve", "--config", str(self.config_path)],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True,  # a Ctrl-C meant for the caller must not stop it first
        )
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.kill()
            raise

    @property
    def pid(self) -> int:
        return self.proc.pid

    def output(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text()

    def wait_ready(self, timeout_s: float) -> None:
        """Until the region is READY and owned by this process and the socket answers."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise ServiceError(f"tiercache serve exited with {self.proc.returncode}:\n"
                                   f"{self.output()}")
            if READY_MARKER in self.output():
                return
            time.sleep(0.02)
        raise ServiceError(f"tiercache serve not ready after {timeout_s} s:\n{self.output()}")

    def stop(self, timeout_s: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            self.proc.wait(timeout_s)
        self._close_files()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._close_files()

    def _close_files(self) -> None:
        if not self._log.closed:
            self._log.close()

    def cleanup(self) -> None:
        """Stop if needed; remove what a killed coordinator left (its region and socket)."""
        self.stop()
        from tiercache.region.stale import remove_stale

        remove_stale(name_prefix=self.config.name)
        try:
            os.unlink(self.config.socket_path)
        except FileNotFoundError:
            pass
        if self._tmp is not None:
            self._tmp.cleanup()

    def __enter__(self) -> CoordinatorProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()
