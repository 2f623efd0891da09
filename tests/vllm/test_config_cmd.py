"""`tiercache config-for-vllm` (no vLLM needed): the geometry vLLM 0.33 announces under its
per-layer KV layout, from a model's config.json and the serving options."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tiercache.config import config_from_dict, load_config
from tiercache.errors import ConfigError
from tiercache.vllm.config_cmd import shape_from_hf_config
from tiercache.vllm.geometry import ModelShape

LLAMA_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
            "hidden_size": 4096, "torch_dtype": "bfloat16"}


@pytest.fixture
def llama_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_8B))
    return tmp_path


@pytest.mark.parametrize("tp, page", [(1, 64 << 10), (4, 16 << 10), (8, 8 << 10)])
def test_llama_8b_pages_per_layer_per_rank(llama_dir, tp, page):
    geometry = shape_from_hf_config(str(llama_dir)).geometry(block_tokens=16, tp_size=tp)
    assert geometry.page_bytes == (page,) * 32 and geometry.world_size == tp


def test_pipeline_stages_split_layers_and_more_ranks_than_kv_heads_replicate(llama_dir):
    shape = shape_from_hf_config(str(llama_dir))
    g = shape.geometry(block_tokens=16, tp_size=16, pp_size=2, blocks_per_chunk=4)
    assert (g.world_size, len(g.page_bytes), g.page_bytes[0], g.block_size_factor) == (
        32, 16, 2 * 1 * 16 * 128 * 2, 4)
    with pytest.raises(ConfigError, match="do not split evenly over PP 3"):
        shape.geometry(block_tokens=16, pp_size=3)
    assert shape_from_hf_config(str(llama_dir), "fp8_e4m3").kv_dtype == "fp8"


def test_the_command_prints_a_config_that_loads(llama_dir, tmp_path):
    out = subprocess.run([sys.executable, "-m", "tiercache", "config-for-vllm", str(llama_dir),
                          "--name", "llama8b", "--capacity", "1GiB", "-tp", "2"],
                         capture_output=True, text=True, check=True, timeout=60)
    path = tmp_path / "node.toml"
    path.write_text(out.stdout)
    config = load_config(path)
    assert config.world_size == 2 and config.kv.page_bytes == (32 << 10,) * 32
    assert config == config_from_dict(__import__("tomllib").loads(out.stdout))


def test_a_missing_or_foreign_model_config_is_one_clear_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tiercache", "config-for-vllm",
                          str(tmp_path / "nope"), "--name", "x", "--capacity", "1GiB"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "does not exist" in out.stderr
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vision"}))
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        shape_from_hf_config(str(tmp_path))
    with pytest.raises(ConfigError, match="kv dtype 'int4'"):
        ModelShape(2, 2, 16, "int4")
