"""A test engine in a process of its own: a control-plane ``Client`` and one real ``Worker``
per rank (``tiercache.attach`` over CPU tensors, the ``cpu`` backend, the real handlers and
their fence), driven by commands over a pipe. It stores keys' deterministic patterns and
loads keys back checking every byte, so integrity tests count wrong bytes end to end.

``EngineProcess`` is the test's side: ``store(keys)``, ``load(keys)``, ``hold_load(keys)`` +
``finish_load()`` (a load whose copy runs later: across a coordinator crash), ``stop()``.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import signal

import numpy as np

from control_support import child_answer, stop_process

SPAWN = mp.get_context("spawn")


def pattern(key: bytes, rank: int, tensor: int, num_bytes: int) -> np.ndarray:
    """The bytes of ``key``'s page of ``tensor`` on ``rank`` (never all zeros)."""
    seed = hashlib.sha256(b"%s|%d|%d" % (key, rank, tensor)).digest()
    return np.frombuffer(seed * (num_bytes // len(seed) + 1), np.uint8)[:num_bytes]


class _Engine:
    """The child's state: the client, the workers and their 'GPU' caches (CPU tensors)."""

    def __init__(self, config_toml: str, num_gpu_blocks: int):
        import tomllib

        import torch

        from tiercache.config import PinningPolicy, config_from_dict
        from tiercache.link.client import Client
        from tiercache.transfer.worker import attach

        self.config = config_from_dict(tomllib.loads(config_toml))
        pages = self.config.kv.page_bytes
        self.caches = {rank: [torch.zeros((num_gpu_blocks, p), dtype=torch.uint8) for p in pages]
                       for rank in range(self.config.world_size)}
        self.workers = {rank: attach(self.config, rank, self.caches[rank], backend="cpu",
                                     pinning=PinningPolicy.ALLOW_UNPINNED, ready_timeout_s=30)
                        for rank in range(self.config.world_size)}
        self.client = Client(self.config, timeout_s=10, name=f"engine {os.getpid()}")
        self.next_job = 1
        self.held: tuple[list[bytes], object] | None = None

    def _copy(self, store: bool, cpu_spec, n: int) -> bool:
        from tiercache.specs import GPULoadStoreSpec

        gpu = GPULoadStoreSpec(list(range(n)))
        jobs = []
        for worker in self.workers.values():
            job, self.next_job = self.next_job, self.next_job + 1
            if store:
                worker.submit_store(job, gpu, cpu_spec)
            else:
                worker.submit_load(job, cpu_spec, gpu)
            jobs.append((worker, job))
        ok = True
        for worker, job in jobs:
            worker.wait([job])
            ok &= all(r.success for r in worker.get_finished())
        return ok

    def store(self, keys: list[bytes]) -> dict:
        out = self.client.prepare_store(keys)
        if out is None:
            return {"stored": 0, "refused": True, "ok": True}
        todo = list(out.keys_to_store)
        for i, key in enumerate(todo):
            for rank, caches in self.caches.items():
                for t, tensor in enumerate(caches):
                    tensor[i].numpy()[:] = pattern(key, rank, t, tensor.shape[1])
        ok = self._copy(True, out.store_spec, len(todo)) if todo else True
        self.client.complete_store(todo, success=ok)
        return {"stored": len(todo) if ok else 0, "refused": False, "ok": ok}

    def hold_load(self, keys: list[bytes]) -> dict:
        hits = self.client.lease(keys).num_hit
        held = keys[:hits]
        self.held = (held, self.client.prepare_load(held) if held else None)
        return {"hits": hits}

    def finish_load(self) -> dict:
        keys, spec = self.held or ([], None)
        self.held = None
        if not keys:
            return {"hits": 0, "wrong": 0, "ok": True}
        for caches in self.caches.values():
            for tensor in caches:
                tensor.zero_()
        ok = self._copy(False, spec, len(keys))
        wrong = 0
        for i, key in enumerate(keys):
            for rank, caches in self.caches.items():
                for t, tensor in enumerate(caches):
                    got = tensor[i].numpy()
                    wrong += int(np.count_nonzero(got != pattern(key, rank, t, got.size)))
        self.client.complete_load(keys)
        self.client.release(keys)
        return {"hits": len(keys), "wrong_bytes": wrong if ok else 0, "ok": ok}

    def load(self, keys: list[bytes]) -> dict:
        self.hold_load(keys)
        return self.finish_load()

    def close(self) -> None:
        for worker in self.workers.values():
            worker.close()
        self.client.close()


def engine_main(config_toml: str, num_gpu_blocks: int, conn) -> None:
    """Child: serve commands until ("stop",); every reply is ("ok", result) or ("error",
    "ExceptionName: message")."""
    engine = _Engine(config_toml, num_gpu_blocks)
    conn.send(("ok", {"pid": os.getpid()}))
    while True:
        verb, *args = conn.recv()
        if verb == "stop":
            engine.close()
            conn.send(("ok", {}))
            return
        try:
            conn.send(("ok", getattr(engine, verb)(*args)))
        except Exception as e:  # reported to the test, which decides
            conn.send(("error", f"{type(e).__name__}: {e}"))


class EngineProcess:
    """The test's handle on an ``engine_main`` child."""

    def __init__(self, config_toml: str, num_gpu_blocks: int = 64):
        self._conn, child = SPAWN.Pipe()
        self.proc = SPAWN.Process(target=engine_main, args=(config_toml, num_gpu_blocks, child),
                                  daemon=True)
        self.proc.start()
        self.pid = self._reply()["pid"]

    def _reply(self):
        status, value = child_answer(self._conn, self.proc, "engine")
        if status != "ok":
            raise RuntimeError(value)
        return value

    def call(self, verb: str, *args):
        self._conn.send((verb, *args))
        return self._reply()

    def store(self, keys):
        return self.call("store", list(keys))

    def load(self, keys):
        return self.call("load", list(keys))

    def hold_load(self, keys):
        return self.call("hold_load", list(keys))

    def finish_load(self):
        return self.call("finish_load")

    def freeze(self) -> None:
        stop_process(self.proc.pid)

    def thaw(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc.is_alive():
            try:
                self.call("stop")
            finally:
                self.proc.join(30)
        self.kill()

    def kill(self) -> None:
        if self.proc.is_alive():
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.kill()
        self.proc.join(30)
        self._conn.close()
