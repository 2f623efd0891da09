"""A vLLM 0.33 engine (tests/vllm/vllm_harness: vLLM's real scheduler and
OffloadingConnector with TierCacheOffloadingSpec, CPU KV) run by the side-by-side test in
.venv-vllm's python:
``python vllm_side.py CONFIG MODEL_DIR`` stores ``PROMPT`` (request r1), fills its GPU with
another request, then asks for ``PROMPT`` again (r2) and prints, as JSON, the tokens r1 and
r2 loaded from tiercache (r1 loads what an earlier run left there). The harness checks every
loaded block against its content rule (a wrong byte fails the run)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent / "vllm"), str(HERE.parent / "support")]

PROMPT = list(range(100))  # 6 full blocks and a partial one
OTHER = [200 + (i % 50) for i in range(230)]  # takes every GPU block of a 16-block engine


def main(config_path: str, model_dir: str) -> None:
    from vllm_harness import Engine, TinyModel

    engine = Engine.build(TinyModel(), Path(model_dir), Path(config_path), num_gpu_blocks=16)
    try:
        engine.add_request("r1", PROMPT)
        engine.run()
        engine.add_request("between", OTHER)
        engine.run()
        engine.add_request("r2", PROMPT + [1, 2, 3])
        engine.run()
        print(json.dumps({"r1": engine.loaded_tokens("r1"), "r2": engine.loaded_tokens("r2")}))
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
