"""An engine in its own process (two-engine and SIGKILL tests): ``python engine_proc.py
CONFIG MODEL_DIR MODE [SALT]``. Prints one JSON line per milestone on stdout.

Modes: ``run SEED``: run one request of ``prompt(SEED)`` to the end, print the tokens it
loaded from tiercache, exit. ``hold SEED``: take leases on ``prompt(SEED)``'s chunks and
reserve a store, print ``holding``, then wait to be killed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from vllm_harness import Engine, TinyModel


def prompt(seed: int, length: int = 96) -> list[int]:
    return [(seed * 31 + i) % 250 for i in range(length)]


def engine_process(coordinator, model_dir, *args) -> subprocess.Popen:
    """This script in a process of its own, for ``coordinator``'s config: ``args`` are
    MODE SEED [SALT]; its stdin and stdout are pipes."""
    return subprocess.Popen([sys.executable, __file__, str(coordinator.config_path),
                             str(model_dir), *map(str, args)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def run_engine(coordinator, model_dir, seed, salt="") -> dict:
    """``run SEED [SALT]`` in its own process, to its exit (its exit ends the wait:
    pytest-timeout is the backstop, and a cut wait kills it); its last JSON line."""
    proc = engine_process(coordinator, model_dir, "run", seed, *([salt] if salt else []))
    try:
        out, _ = proc.communicate()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"engine process exited {proc.returncode}"
    return json.loads(out.strip().splitlines()[-1])


def say(**fields) -> None:
    print(json.dumps(fields), flush=True)


def main(argv: list[str]) -> int:
    config, model_dir, mode, seed = Path(argv[0]), Path(argv[1]), argv[2], int(argv[3])
    salt = argv[4] if len(argv) > 4 else ""
    extra = {"tiercache_namespace_salt": salt} if salt else {}
    engine = Engine.build(TinyModel(), model_dir, config, num_gpu_blocks=16, extra=extra)
    if mode == "run":
        engine.add_request("r", prompt(seed) + [1])
        engine.run()
        say(loaded_tokens=engine.loaded_tokens("r"),
            namespace=engine.manager.namespace.digest.hex())
        engine.shutdown()
        return 0
    if mode == "hold":
        from vllm.v1.kv_offload.base import ReqContext, make_offload_key

        engine.add_request("r", prompt(seed) + [1])
        engine.step()  # lookups: RETRY, probed after the step
        leased = engine.manager.book.num_held
        ctx = ReqContext("store")
        with engine.manager.lock:
            engine.manager.on_new_request(ctx)
            out = engine.manager.prepare_store([make_offload_key(b"x" * 32, 0)], ctx)
        say(holding=True, leased=leased, reserved=len(out.keys_to_store))
        sys.stdin.read()  # until killed
        return 0
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
