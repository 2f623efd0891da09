"""A real Prometheus server for tests: Debian's ``prometheus`` binary on 127.0.0.1, a
temporary TSDB, one scrape job; queried over its HTTP API. ``stop()`` always runs
(use it as a context manager) and kills the server if SIGTERM is not enough."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

from metrics_support import require_tool

POLL_S = 0.2
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
JOB = "tiercache"


def prometheus_binary() -> str:
    return require_tool("prometheus", "the end-to-end metrics test")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PrometheusServer:
    def __init__(self, target: str, workdir: Path, scrape_interval_s: int = 1):
        self.target = target
        self.workdir = workdir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        config = {
            "global": {"scrape_interval": f"{scrape_interval_s}s",
                       "scrape_timeout": f"{scrape_interval_s}s",
                       "evaluation_interval": f"{scrape_interval_s}s"},
            "scrape_configs": [{"job_name": JOB, "static_configs": [{"targets": [target]}]}],
        }
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(json.dumps(config))  # JSON is YAML
        self.log_path = workdir / "prometheus.log"
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(
            [prometheus_binary(), f"--config.file={self.config_path}",
             f"--storage.tsdb.path={workdir / 'tsdb'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--log.level=warn"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            self.wait_until(self._ready, START_TIMEOUT_S, "Prometheus ready")
        except BaseException:
            self.stop()
            raise

    # ------------------------------------------------------------ HTTP API
    def _ready(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"prometheus exited with {self.proc.returncode}:\n{self.output()}")
        try:
            with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError):
            return False

    def api(self, path: str, **params: str) -> dict:
        url = f"{self.url}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        try:
            with urllib.request.urlopen(url, timeout=10) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as e:
            raise AssertionError(f"Prometheus refused {params}: {e.read().decode()}") from e
        assert body["status"] == "success", body
        return body["data"]

    def query(self, expr: str) -> list[dict]:
        """Instant query now: the result list (``metric`` labels and ``value``)."""
        return self.api("query", query=expr)["result"]

    def value(self, expr: str) -> float | None:
        """The value of a query expected to give at most one series."""
        result = self.query(expr)
        assert len(result) <= 1, f"{expr} gave {len(result)} series"
        return float(result[0]["value"][1]) if result else None

    def samples(self, expr: str, window_s: int) -> list[tuple[float, float]]:
        """Raw (timestamp, value) samples of one series over the last ``window_s``."""
        result = self.api("query", query=f"{expr}[{window_s}s]")["result"]
        assert len(result) == 1, f"{expr} gave {len(result)} series"
        return [(float(t), float(v)) for t, v in result[0]["values"]]

    def target_health(self) -> dict:
        targets = self.api("targets")["activeTargets"]
        (mine,) = [t for t in targets if t["labels"]["job"] == JOB]
        return mine

    # ------------------------------------------------------------ waiting and stopping
    @staticmethod
    def wait_until(condition, timeout_s: float, what: str) -> float:
        """Poll ``condition`` until true; seconds it took. Raises after ``timeout_s``."""
        start = time.monotonic()
        while True:
            if condition():
                return time.monotonic() - start
            if time.monotonic() - start > timeout_s:
                raise TimeoutError(f"waited {timeout_s} s for {what}")
            time.sleep(POLL_S)

    def output(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(STOP_TIMEOUT_S)
        if not self._log.closed:
            self._log.close()

    def __enter__(self) -> PrometheusServer:
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
