"""The model matrix (docs/vllm.md, "Models"): for each popular family, `tiercache
config-for-vllm` prints the geometry vLLM 0.33's workers announce, or refuses in one line;
the printed config attaches and round-trips every block byte-exact through vLLM's real
scheduler and OffloadingConnector (KV-cache groups of the hybrid allocator included).

The models are their published config.json files (tests/fixtures/models, written from the
model cards, no weights). The expected pages here are the cards' arithmetic, independent of
the code under test: K and V of the rank's KV heads per layer per 16-token block, MLA one
latent of kv_lora_rank + qk_rope_head_dim per token and layer; the hybrid allocator puts
one tensor per layer of each group position (gpt-oss: 12 full + 12 sliding layers share 12
tensors; Gemma 3: 8 full + 40 sliding layers in six groups of 8 share 8).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from vllm_env import require_vllm

require_vllm()

import pytest  # noqa: E402

from tiercache.config import load_config  # noqa: E402
from tiercache.service.process import CoordinatorProcess  # noqa: E402
from tiercache.vllm.model_kv import ServingOptions  # noqa: E402
from vllm_harness import BLOCK_TOKENS, Engine  # noqa: E402

MODELS = Path(__file__).parents[1] / "fixtures" / "models"
# Gemma 3's published config is its multimodal wrapper, whose vLLM module imports
# torchvision; this venv has none (its wheels need a CUDA torch), the SGLang tests' stub
# stands in for the import (nothing here calls it).
STUBS = Path(__file__).parents[1] / "sglang" / "stubs"
BF16, FP8 = 2, 1


def dense(layers: int, kv_heads: int, head_dim: int, tp: int = 1, itemsize: int = BF16):
    return (2 * max(1, kv_heads // tp) * BLOCK_TOKENS * head_dim * itemsize,) * layers


def mla(layers: int, kv_lora_rank: int = 512, rope: int = 64, itemsize: int = BF16):
    return ((kv_lora_rank + rope) * BLOCK_TOKENS * itemsize,) * layers


# (model, vLLM flags, pages per rank, world size, KV-cache groups)
SERVED = [
    ("Llama-3.1-8B-Instruct", [], dense(32, 8, 128), 1, 1),
    ("Llama-3.1-8B-Instruct", ["-tp", "2"], dense(32, 8, 128, tp=2), 2, 1),
    ("Llama-3.1-8B-Instruct", ["-tp", "8", "-pp", "2"], dense(16, 8, 128, tp=8), 16, 1),
    ("Llama-3.1-8B-Instruct", ["--kv-cache-dtype", "fp8"], dense(32, 8, 128, itemsize=FP8),
     1, 1),
    ("Qwen3-8B", [], dense(36, 8, 128), 1, 1),
    ("DeepSeek-V2-Lite", [], mla(27), 1, 1),
    ("DeepSeek-V2-Lite", ["--kv-cache-dtype", "fp8"], mla(27, itemsize=FP8), 1, 1),
    ("DeepSeek-V3", ["-tp", "8"], mla(61), 8, 1),
    ("gpt-oss-20b", [], dense(12, 8, 64), 1, 2),
    ("gpt-oss-20b", ["--disable-hybrid-kv-cache-manager"], dense(24, 8, 64), 1, 1),
    ("gemma-3-12b-it", [], dense(8, 8, 256), 1, 6),
]
REFUSED = [
    ("Qwen3-Next-80B-A3B-Instruct", "Qwen3NextForCausalLM: 36 of its 48 layers keep recurrent"),
    ("Nemotron-H-8B-Base-8K", "NemotronHForCausalLM: 24 of its 52 layers keep recurrent"),
    ("Llama-3.1-8B-Instruct", "split unevenly over --pipeline-parallel-size 3"),
]


def stub_path() -> str:
    return os.pathsep.join(filter(None, [str(STUBS), os.environ.get("PYTHONPATH")]))


@pytest.fixture(autouse=True)
def torchvision_stub(monkeypatch):
    """For this process and the model inspection vLLM runs in a child."""
    monkeypatch.syspath_prepend(str(STUBS))
    monkeypatch.setenv("PYTHONPATH", stub_path())


@pytest.fixture
def config_for_vllm(capsys):
    """``tiercache config-for-vllm MODEL ARGS`` in this process (vLLM imported once per
    worker, not per command): (exit status, stdout, stderr)."""
    from tiercache.cli import main

    def run(model: str, *args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        status = main(["config-for-vllm", str(MODELS / model), *args])
        out = capsys.readouterr()
        return status, out.out, out.err

    return run


@pytest.mark.parametrize("model, flags, pages, world_size, groups", SERVED,
                         ids=[f"{m}{''.join(f)}" for m, f, *_ in SERVED])
def test_the_printed_geometry_is_the_model_cards(config_for_vllm, model, flags, pages,
                                                 world_size, groups):
    status, out, err = config_for_vllm(model, "--name", "m", "--capacity", "1GiB", *flags)
    assert status == 0, err
    printed = tomllib.loads(out)
    assert printed["kv"]["page_bytes"] == list(pages)
    assert printed["instance"]["world_size"] == world_size
    assert printed["region"]["capacity"] == "1GiB" and printed["region"]["pinning"] == "required"
    header = out.splitlines()[0]
    assert f"{groups} KV-cache group(s)" in header, header


@pytest.mark.parametrize("model, reason", REFUSED, ids=[m for m, _ in REFUSED])
def test_models_tiercache_cannot_serve_are_refused_in_one_line(config_for_vllm, model, reason):
    flags = ["-pp", "3"] if "pipeline" in reason else []
    status, out, err = config_for_vllm(model, "--name", "m", "--capacity", "1GiB", *flags)
    assert status == 1 and out == ""
    assert err.startswith("tiercache: error: ") and err.count("\n") == 1 and reason in err, err


def test_the_command_as_typed_refuses_a_mamba_hybrid_in_one_line():
    """The installed command in a fresh process: exit 1, nothing on stdout, one error line
    (besides torch's own note, on this CPU-only venv, that Triton is missing)."""
    out = subprocess.run([sys.executable, "-m", "tiercache", "config-for-vllm",
                          str(MODELS / "Nemotron-H-8B-Base-8K"), "--name", "m", "--capacity",
                          "1GiB"], capture_output=True, text=True)
    assert out.returncode == 1 and out.stdout == ""
    ours = [line for line in out.stderr.splitlines() if "Triton not available" not in line]
    assert len(ours) == 1 and ours[0].startswith("tiercache: error: NemotronHForCausalLM: "
                                                 "24 of its 52 layers keep recurrent state")


ROUND_TRIP = [("Llama-3.1-8B-Instruct", []), ("Qwen3-8B", []), ("DeepSeek-V2-Lite", []),
              ("DeepSeek-V3", []), ("gpt-oss-20b", []), ("gemma-3-12b-it", []),
              ("Llama-3.1-8B-Instruct", ["--kv-cache-dtype", "fp8"]),
              ("DeepSeek-V2-Lite", ["--kv-cache-dtype", "fp8"])]


@pytest.mark.slow
@pytest.mark.parametrize("model, flags", ROUND_TRIP, ids=[m + "".join(f) for m, f in ROUND_TRIP])
def test_the_printed_config_round_trips_every_block_through_vllm(config_for_vllm, model, flags,
                                                                  tmp_path, instance_name):
    """A 300-token prompt (18 full blocks: past gpt-oss's 128-token window, so its sliding
    group drops blocks) is computed and offloaded; the GPU prefix cache is reset, and the
    same prompt again loads every full block from tiercache, each checked byte for byte
    against the content rule (vllm_harness) in every layer of every group."""
    status, out, err = config_for_vllm(
        model, "--name", instance_name, "--capacity", "256MiB", "--socket",
        str(tmp_path / "c.sock"), "--exporter-port", "0", "--pinning", "allow_unpinned", *flags)
    assert status == 0, err
    printed = tmp_path / "printed.toml"
    printed.write_text(out)
    coordinator = CoordinatorProcess(load_config(printed), workdir=tmp_path / "coord")
    dtype = flags[flags.index("--kv-cache-dtype") + 1] if flags else "auto"
    engine = None
    try:
        # every KV-cache group holds the prompt's blocks (Gemma 3: six groups, 1024-token
        # windows): room for them all, and for a chunk of the next request
        blocks = 40 * (6 if model.startswith("gemma") else 2)
        engine = Engine.build_for(MODELS / model, printed, ServingOptions(kv_cache_dtype=dtype),
                                  num_gpu_blocks=blocks)
        prompt = [(7 * i) % 251 + 1 for i in range(300)]
        engine.add_request("first", prompt)
        engine.run()
        assert not engine.manager.book.writing, "the first request's stores completed"
        assert engine.scheduler.reset_prefix_cache(), "nothing runs: the GPU cache resets"
        engine.add_request("again", prompt + [3, 2, 1])
        engine.run()
        assert engine.loaded_tokens("again") == (300 // BLOCK_TOKENS) * BLOCK_TOKENS
        assert engine.finished_loads and all(r.checked for r in engine.finished_loads)
    finally:
        if engine is not None:
            engine.shutdown()
        coordinator.cleanup()
