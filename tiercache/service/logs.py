"""How the ``tiercache`` command logs: one format, on stderr, every line timestamped.

``text`` (the default)::

    2026-05-01T12:00:00.123+02:00 INFO tiercache.serve: ready in 0.12 s (32.00 MiB); ...

ISO-8601 local time with its UTC offset, level, logger, message (a traceback follows on
its own lines). ``json`` (``--log-format json``, or ``TIERCACHE_LOG_FORMAT=json``) writes
one object per line for log shippers: ``{"ts": ..., "level": ..., "logger": ..., "msg":
...}``, plus ``"exc"`` (the traceback) when there is one.

``tiercache serve``'s start-up and shutdown steps are INFO records of ``STEP_LOGGER``,
shown whatever ``--log-level`` says: they are the command's output (journald keeps each
with its time; a step that runs long reports its progress, ``tiercache.region.progress``).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from datetime import datetime
from enum import Enum
from typing import TextIO

from tiercache.errors import ArgumentError

STEP_LOGGER = "tiercache.serve"
LOG_FORMAT_ENV = "TIERCACHE_LOG_FORMAT"


def _timestamp(record: logging.LogRecord) -> str:
    return datetime.fromtimestamp(record.created).astimezone().isoformat(timespec="milliseconds")


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = f"{_timestamp(record)} {record.levelname} {record.name}: {record.getMessage()}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry = {"ts": _timestamp(record), "level": record.levelname, "logger": record.name,
                 "msg": record.getMessage()}
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class LogFormat(Enum):
    TEXT = "text"
    JSON = "json"

    @classmethod
    def parse(cls, value: str, key: str) -> LogFormat:
        try:
            return cls(value)
        except ValueError:
            raise ArgumentError(f"{key} = {value!r}: allowed "
                                + ", ".join(repr(f.value) for f in cls)) from None

    @classmethod
    def from_env(cls) -> LogFormat:
        """``TIERCACHE_LOG_FORMAT``, text when unset."""
        return cls.parse(os.environ.get(LOG_FORMAT_ENV) or cls.TEXT.value, LOG_FORMAT_ENV)

    def formatter(self) -> logging.Formatter:
        return JsonFormatter() if self is LogFormat.JSON else TextFormatter()


def configure(level: str, log_format: LogFormat, stream: TextIO | None = None) -> None:
    """Every record at ``level`` or above, and every step of ``STEP_LOGGER``, to ``stream``
    (stderr) in ``log_format``."""
    handler = logging.StreamHandler(sys.stderr if stream is None else stream)
    handler.setFormatter(log_format.formatter())
    logging.basicConfig(level=level, handlers=[handler], force=True)
    logging.getLogger(STEP_LOGGER).setLevel(logging.INFO)
