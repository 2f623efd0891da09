"""One log format on stderr: ``serve``'s start-up steps and logging alike, each line an
ISO-8601 timestamp, level, logger and message; ``--log-format json`` (or
``TIERCACHE_LOG_FORMAT=json``) one JSON object per line. Real ``serve`` processes."""

from __future__ import annotations

import json
import logging
import os
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from tiercache.config import config_to_toml
from tiercache.service.logs import LOG_FORMAT_ENV, STEP_LOGGER, LogFormat

START_TIMEOUT_S = 60
# 2026-05-01T12:00:00.123+02:00 (local time with its UTC offset)
ISO_8601 = r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}[+-]\d\d:\d\d"


def _record(msg: str, level: int = logging.INFO, exc: bool = False) -> logging.LogRecord:
    exc_info = None
    if exc:
        try:
            raise ValueError("boom")
        except ValueError:
            exc_info = sys.exc_info()
    return logging.LogRecord(STEP_LOGGER, level, __file__, 1, msg, None, exc_info)


def test_text_is_timestamp_level_logger_message():
    line = LogFormat.TEXT.formatter().format(_record("ready in 0.12 s"))
    assert re.fullmatch(f"{ISO_8601} INFO tiercache.serve: ready in 0.12 s", line), line


def test_json_is_one_object_per_record_with_ts_level_logger_msg():
    line = LogFormat.JSON.formatter().format(_record('a "quoted"\nmessage', logging.WARNING))
    assert "\n" not in line
    entry = json.loads(line)
    assert set(entry) == {"ts", "level", "logger", "msg"}
    assert re.fullmatch(ISO_8601, entry["ts"]) and entry["level"] == "WARNING"
    assert entry["logger"] == STEP_LOGGER and entry["msg"] == 'a "quoted"\nmessage'
    with_traceback = json.loads(LogFormat.JSON.formatter().format(_record("failed", exc=True)))
    assert with_traceback["exc"].startswith("Traceback") and "boom" in with_traceback["exc"]


class Serve:
    """``tiercache serve`` with its stderr read as it comes."""

    def __init__(self, config_path, *args: str, env: dict[str, str] | None = None):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tiercache", "serve", "--config", str(config_path), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
            env={**os.environ, **(env or {})}, start_new_session=True)
        self.err = b""

    def wait_for(self, text: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        fd = self.proc.stderr.fileno()
        while text.encode() not in self.err:
            left = deadline - time.monotonic()
            assert left > 0 and self.proc.poll() is None, self.err.decode()
            if select.select([fd], [], [], left)[0]:
                self.err += os.read(fd, 1 << 16)

    def stop(self) -> tuple[str, list[str]]:
        """SIGTERM, then its stdout and every stderr line."""
        self.proc.send_signal(signal.SIGTERM)
        try:  # its exit ends the wait (pytest-timeout is the backstop)
            out, err = self.proc.communicate()
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
        assert self.proc.returncode == 0, err
        return out.decode(), (self.err + err).decode().splitlines()


@pytest.fixture
def config_path(make_config, tmp_path):
    path = tmp_path / "c.toml"
    path.write_text(config_to_toml(make_config()))
    return path


def test_every_start_up_step_is_a_timestamped_line_on_stderr(config_path):
    """docs/deploy.md: journalctl has every start-up step with its time; stdout was where
    the steps went, untimed, while logging went to stderr."""
    serve = Serve(config_path)
    serve.wait_for("ready in ")
    out, lines = serve.stop()
    assert out == ""
    steps = [line for line in lines if f" INFO {STEP_LOGGER}: " in line]
    for line in lines:
        assert re.match(f"{ISO_8601} (DEBUG|INFO|WARNING|ERROR) [\\w.]+: ", line), line
    said = "".join(steps)
    for step in ("allocated ", "pre-faulted the header", "control socket", "metrics: http",
                 "ready in ", "SIGTERM: shutting down", "stopped; removed region"):
        assert step in said, said


@pytest.mark.parametrize("how", ["flag", "env"])
def test_json_gives_one_object_per_line_steps_included(config_path, how):
    args, env = (["--log-format", "json"], None) if how == "flag" else ([], {LOG_FORMAT_ENV:
                                                                            "json"})
    serve = Serve(config_path, *args, env=env)
    serve.wait_for('"msg": "ready in ')
    out, lines = serve.stop()
    assert out == ""
    entries = [json.loads(line) for line in lines]
    assert all(set(e) == {"ts", "level", "logger", "msg"} for e in entries), entries
    steps = [e["msg"] for e in entries if e["logger"] == STEP_LOGGER and e["level"] == "INFO"]
    assert steps[-1].startswith("stopped; removed region") and any(
        s.startswith("allocated ") for s in steps), steps


def test_a_refused_start_in_json_is_one_error_object(make_config, tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[instance]\nname = "x"\n[region]\ncapacity = "lots"\n')
    serve = subprocess.run([sys.executable, "-m", "tiercache", "--log-format", "json", "serve",
                            "--config", str(path)], capture_output=True, text=True,
                           timeout=START_TIMEOUT_S)
    assert serve.returncode == 1 and serve.stdout == ""
    [line] = serve.stderr.splitlines()
    entry = json.loads(line)
    assert entry["level"] == "ERROR" and entry["msg"].startswith("error: region.capacity = ")


def test_an_unknown_format_is_bad_usage():
    for args, env in ((["--log-format", "xml", "status"], {}),
                      (["status", "--name", "x-none"], {LOG_FORMAT_ENV: "xml"})):
        result = subprocess.run([sys.executable, "-m", "tiercache", *args], capture_output=True,
                                text=True, timeout=START_TIMEOUT_S, env={**os.environ, **env})
        assert result.returncode == 2 and "xml" in result.stderr, result.stderr
