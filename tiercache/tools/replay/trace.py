"""A replay trace: requests in arrival order, in a documented JSONL format.

One request per line, a JSON object::

    {"t": 12.5, "session": "chat-17", "prompt_token_ids": [1201, 88, ...], "output_len": 214}

* ``t``: arrival in seconds from the start of the trace (a number >= 0; lines may come in
  any order, the reader sorts them stably by ``t``);
* ``session``: a non-empty string naming the conversation, tenant or user the request
  belongs to (reported, and a hint a router may use; nothing requires it to be unique);
* ``prompt_token_ids``: the prompt, a non-empty list of token ids (ints >= 0);
* ``output_len``: tokens to generate (an int >= 1; the engine ignores EOS).

Other keys are ignored, so a trace may carry its own annotations. A line that breaks these
rules stops the reader with one line naming the file, the line and the field
(``TraceError``); blank lines are skipped.

What an engine answers: the replay's engines emit ``response_token_ids(prompt, n)``, a
deterministic function of the prompt, so a trace whose next turn re-sends the previous
answer (``chat``) can find that answer's KV cached, as a served model's would be.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tiercache.errors import TraceError

RESPONSE_TOKEN_RANGE = (1000, 30000)  # ids every Llama-family vocabulary has, no specials


@dataclass(frozen=True)
class TraceRequest:
    """One line of a trace (see the module docstring)."""

    t: float
    session: str
    prompt_token_ids: tuple[int, ...]
    output_len: int

    def __post_init__(self) -> None:
        if not self.t >= 0:
            raise TraceError(f"t = {self.t!r}: must be a number >= 0 (seconds)")
        if not self.session:
            raise TraceError("session = '': must be a non-empty string")
        if not self.prompt_token_ids:
            raise TraceError("prompt_token_ids = []: a prompt needs at least one token")
        if self.output_len < 1:
            raise TraceError(f"output_len = {self.output_len}: must be >= 1")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def to_json(self) -> str:
        return json.dumps({"t": round(self.t, 6), "session": self.session,
                           "prompt_token_ids": list(self.prompt_token_ids),
                           "output_len": self.output_len}, separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str, where: str) -> TraceRequest:
        """Parse one line; ``where`` ('file:line') starts every error message."""
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise TraceError(f"{where}: not JSON ({e.msg} at column {e.colno})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: a request is a JSON object, got {type(obj).__name__}")
        try:
            return cls(t=_number(obj, "t"), session=_field(obj, "session", str),
                       prompt_token_ids=_tokens(obj), output_len=_field(obj, "output_len", int))
        except TraceError as e:
            raise TraceError(f"{where}: {e}") from None


def _field(obj: dict[str, Any], name: str, kind: type) -> Any:
    if name not in obj:
        raise TraceError(f"no {name!r} field")
    value = obj[name]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TraceError(f"{name} = {value!r}: must be {kind.__name__}")
    return value


def _number(obj: dict[str, Any], name: str) -> float:
    if name not in obj:
        raise TraceError(f"no {name!r} field")
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TraceError(f"{name} = {value!r}: must be a number (seconds)")
    return float(value)


def _tokens(obj: dict[str, Any]) -> tuple[int, ...]:
    tokens = _field(obj, "prompt_token_ids", list)
    for i, token in enumerate(tokens):
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise TraceError(f"prompt_token_ids[{i}] = {token!r}: token ids are ints >= 0")
    return tuple(tokens)


@dataclass(frozen=True)
class Trace:
    """Requests sorted by arrival, and how they were made (``source``: a file or a
    generator with its parameters and the sources of its length distributions)."""

    requests: tuple[TraceRequest, ...]
    source: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.requests:
            raise TraceError("a trace needs at least one request")
        ordered = tuple(sorted(self.requests, key=lambda r: r.t))
        object.__setattr__(self, "requests", ordered)

    @property
    def prompt_tokens(self) -> int:
        return sum(r.prompt_len for r in self.requests)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].t - self.requests[0].t

    def summary(self) -> dict[str, Any]:
        """What the report's ``trace`` field says of it."""
        lengths = [r.prompt_len for r in self.requests]
        return {**self.source, "requests": len(self.requests),
                "sessions": len({r.session for r in self.requests}),
                "prompt_tokens": self.prompt_tokens,
                "prompt_len_mean": round(float(np.mean(lengths)), 1),
                "prompt_len_max": max(lengths),
                "output_tokens": sum(r.output_len for r in self.requests),
                "duration_s": round(self.duration_s, 3)}

    def write(self, path: str | Path) -> None:
        Path(path).write_text("".join(r.to_json() + "\n" for r in self.requests))

    @classmethod
    def read(cls, path: str | Path) -> Trace:
        """See the module docstring; errors are one line naming the file and line."""
        path = Path(path)
        try:
            text = path.read_text()
        except OSError as e:
            raise TraceError(f"trace {str(path)!r}: {e.strerror or e}") from None
        requests = [TraceRequest.from_json(line, f"{path}:{number}")
                    for number, line in enumerate(text.splitlines(), 1) if line.strip()]
        if not requests:
            raise TraceError(f"trace {str(path)!r}: no requests in it")
        return cls(tuple(requests), {"file": str(path)})


def response_token_ids(prompt_token_ids: Sequence[int], output_len: int) -> list[int]:
    """The tokens a replayed engine generates for this prompt (see the module docstring)."""
    seed = hashlib.sha256(np.asarray(prompt_token_ids, dtype=np.int64).tobytes()).digest()
    rng = np.random.default_rng(int.from_bytes(seed[:8], "little"))
    low, high = RESPONSE_TOKEN_RANGE
    return rng.integers(low, high, size=output_len).tolist()


def concat(parts: Iterable[Sequence[int]]) -> tuple[int, ...]:
    out: list[int] = []
    for part in parts:
        out.extend(part)
    return tuple(out)
