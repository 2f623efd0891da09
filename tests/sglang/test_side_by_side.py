"""A vLLM engine and SGLang engines on one coordinator: one region geometry serves both (an
SGLang page is a row's bytes; a vLLM block is the same row as per-layer pages), they share
one budget and one eviction order, and their keys never meet: each loads exactly its own
bytes. vLLM runs in .venv-vllm (``TIERCACHE_VLLM_PYTHON``, default ``.venv-vllm/bin/python``
of this checkout; both are built by ``make test``), SGLang in this process."""

from __future__ import annotations

from sglang_env import require_sglang

require_sglang()

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from sglang_harness import ModelSpec, tokens_of  # noqa: E402
from tiercache.config import Config, ExporterConfig, KVGeometry, RegionConfig, load_config  # noqa: E402
from tiercache.link.client import Client  # noqa: E402
from tiercache.service.process import CoordinatorProcess  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = os.environ.get("TIERCACHE_VLLM_PYTHON", str(ROOT / ".venv-vllm" / "bin" / "python"))
# vLLM's tiny test model (tests/vllm/vllm_harness.TinyModel): 2 layers, 2 KV heads of 16,
# float16, 16-token blocks: rows of 2 layer pages of 2 x 2 x 16 x 16 x 2 = 2048 bytes
VLLM_PAGE = 2048
SGLANG = ModelSpec(name="tiny-llama", layers=2, heads=2, head_dim=16, dtype="float16")
PROMPT_BLOCKS = 6


def _vllm(config_path: Path, model_dir: Path) -> tuple[int, int]:
    """One vLLM engine's run: tokens its requests r1 and r2 loaded."""
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests' / 'support'}"}
    done = subprocess.run([VLLM_PYTHON, str(Path(__file__).with_name("vllm_side.py")),
                           str(config_path), str(model_dir)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    return loaded["r1"], loaded["r2"]


@pytest.fixture
def shared(instance_name, tmp_path):
    if not os.access(VLLM_PYTHON, os.X_OK):
        pytest.skip(f"no vLLM environment at {VLLM_PYTHON} (make venv-vllm, or set "
                    "TIERCACHE_VLLM_PYTHON)")
    config = Config(name=instance_name, world_size=1,
                    kv=KVGeometry(page_bytes=(VLLM_PAGE, VLLM_PAGE), block_tokens=16),
                    region=RegionConfig(capacity_bytes=None, num_blocks=48, prefault_threads=1),
                    exporter=ExporterConfig(port=0), control_socket=str(tmp_path / "c.sock"),
                    index_max_session_share=1.0)
    model_dir = tmp_path / "tiny-llama"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
        "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "num_hidden_layers": 2, "head_dim": 16, "vocab_size": 256,
        "max_position_embeddings": 4096, "torch_dtype": "float16", "rms_norm_eps": 1e-5}))
    with CoordinatorProcess(config, workdir=tmp_path / "coord") as coordinator:
        yield coordinator, model_dir


def test_vllm_and_sglang_share_one_region_budget_and_eviction_but_never_keys(shared, make_rank):
    coordinator, model_dir = shared
    full = PROMPT_BLOCKS * 16
    assert _vllm(coordinator.config_path, model_dir) == (0, full)  # cold; every load checked
    index = Client(load_config(coordinator.config_path))
    vllm_blocks = index.stats().ready_blocks
    sglang = make_rank(coordinator, model=SGLANG, model_name=str(model_dir))
    same_tokens = list(range(PROMPT_BLOCKS * 16))  # vLLM's prompt: SGLang's keys differ
    assert sglang.query(same_tokens) == 0
    assert sglang.backup(same_tokens) == len(same_tokens)
    assert sglang.prefetch(same_tokens) == (len(same_tokens), [])
    assert index.stats().ready_blocks == vllm_blocks + PROMPT_BLOCKS  # one budget
    # a new vLLM engine: its blocks are still there, and it loads exactly them (not SGLang's)
    assert _vllm(coordinator.config_path, model_dir) == (full, full)
    # SGLang fills the region: the least recently used pages go, vLLM's among them
    for seed in range(60, 68):
        assert sglang.backup(tokens_of(seed, 6)) == 6 * 16
    assert index.stats().evicted_blocks > 0
    first, again = _vllm(coordinator.config_path, model_dir)
    assert first < full and again == full  # SGLang's pages pushed vLLM's out: one LRU
    assert sglang.prefetch(tokens_of(67, 6)) == (6 * 16, [])
    index.close()
