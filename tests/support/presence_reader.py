"""An engine's key presence view in a process of its own (``tiercache.region.presence``),
driven line by line, so a test can find out whether a call blocks or kills the process
(a FIFO under the map's name, a map cut short under it) without risking its own.

``PresenceReader(name)`` starts it; ``ask("refresh" | "exact" | "maybe KEYHEX")`` sends one
command and returns the child's one-line answer, or fails the test if none comes within
``ANSWER_TIMEOUT_S`` (the child is killed then)."""

from __future__ import annotations

import select
import subprocess
import sys

ANSWER_TIMEOUT_S = 20.0


def _serve(name: str) -> None:  # pragma: no cover - the child
    from tiercache.region.presence import PresenceView

    view = PresenceView(name)
    print(f"open {view.mapped} {view.problem}", flush=True)
    for line in sys.stdin:
        command, _, arg = line.strip().partition(" ")
        if command == "refresh":
            print(f"refresh {view.refresh()} {view.problem}", flush=True)
        elif command == "exact":
            print(f"exact {view.exact()}", flush=True)
        elif command == "maybe":
            print(f"maybe {view.maybe_held(bytes.fromhex(arg))}", flush=True)
    view.close()


class PresenceReader:
    def __init__(self, name: str):
        self.proc = subprocess.Popen([sys.executable, __file__, name], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.opened = self._answer("open")

    def _answer(self, what: str) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], ANSWER_TIMEOUT_S)
        if not ready:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"the reader gave no answer to {what!r} within "
                                 f"{ANSWER_TIMEOUT_S} s: blocked")
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise AssertionError(f"the reader died answering {what!r}: exit status {code}")
        return line.rstrip("\n")

    def ask(self, command: str) -> str:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self._answer(command)

    def close(self) -> int:
        """End the child; its exit status (negative: the signal that killed it)."""
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
            try:
                self.proc.wait(ANSWER_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        return self.proc.returncode


if __name__ == "__main__":  # pragma: no cover - the child
    _serve(sys.argv[1])
