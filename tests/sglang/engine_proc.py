"""An SGLang rank in a process of its own (spawned), driven over a pipe: each message names
an ``SGLangRank`` method and its arguments; the answer is ``("ok", result)`` or
``("error", text)``. With ``dist`` the process joins a gloo group first (a file store) and
hands it to the controller as its TP group, so SGLang's MIN reductions of hit counts and
ACKs run across the rank processes for real."""

from __future__ import annotations

import multiprocessing as mp
import traceback
from typing import Any

from control_support import child_answer


def serve(conn: Any, config_path: str, rank_kwargs: dict, dist: dict | None = None) -> None:
    from sglang_harness import SGLangRank

    import torch

    if dist is not None:
        torch.distributed.init_process_group("gloo", init_method=dist["init"],
                                             rank=dist["rank"], world_size=dist["world"])
        rank_kwargs = {**rank_kwargs, "tp_group": torch.distributed.group.WORLD}
    try:
        rank = SGLangRank(config_path, **rank_kwargs)
    except Exception:
        conn.send(("error", traceback.format_exc()))
        return
    conn.send(("ok", "ready"))
    while True:
        name, args = conn.recv()
        if name == "close":
            rank.close()
            conn.send(("ok", "closed"))
            return
        try:
            result = getattr(rank, name)(*args)
            conn.send(("ok", result))
        except Exception:
            conn.send(("error", traceback.format_exc()))


class RemoteRank:
    """The parent's handle on one rank process."""

    def __init__(self, config_path: str, dist: dict | None = None, **rank_kwargs: Any):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=serve, args=(child, str(config_path), rank_kwargs, dist),
                                daemon=True)
        self.proc.start()
        child.close()

    def started(self) -> RemoteRank:
        self.answer()
        return self

    def send(self, name: str, *args: Any) -> None:
        self.conn.send((name, args))

    def answer(self) -> Any:
        """Until the rank answers or dies (importing SGLang took minutes at load 10+)."""
        status, value = child_answer(self.conn, self.proc, "SGLang rank")
        if status != "ok":
            raise AssertionError(f"rank process {self.proc.pid} failed:\n{value}")
        return value

    def call(self, name: str, *args: Any) -> Any:
        self.send(name, *args)
        return self.answer()

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("close")
            finally:
                self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(10)


def start_all(ranks: list[RemoteRank]) -> list[RemoteRank]:
    """Wait for every rank to be ready (they build their controllers together: a TP
    group's set-up is collective)."""
    for rank in ranks:
        rank.started()
    return ranks


def call_all(ranks: list[RemoteRank], name: str, *args: Any) -> list[Any]:
    """The same call on every rank at once (collectives inside need all of them)."""
    for rank in ranks:
        rank.send(name, *args)
    return [rank.answer() for rank in ranks]
