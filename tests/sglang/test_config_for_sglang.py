"""``tiercache config-for-sglang`` (plain Python) and the attach-time geometry check (with
SGLang's real host pool, where SGLang is installed)."""

from __future__ import annotations

import dataclasses
import json
from importlib.metadata import PackageNotFoundError, version

import pytest

from tiercache.cli import main
from tiercache.config import ExporterConfig, load_config
from tiercache.errors import ConfigError, LayoutMismatchError
from tiercache.region.layout import RegionLayout
from tiercache.sglang.config_cmd import shape_from_hf_config

LLAMA = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
         "hidden_size": 4096, "torch_dtype": "bfloat16"}
DEEPSEEK = {"num_hidden_layers": 61, "num_attention_heads": 128, "kv_lora_rank": 512,
            "qk_rope_head_dim": 64, "hidden_size": 7168, "torch_dtype": "bfloat16"}


def _config(tmp_path, capsys, hf: dict, *args: str):
    (tmp_path / "config.json").write_text(json.dumps(hf))
    assert main(["config-for-sglang", str(tmp_path), "--name", "node", "--capacity", "1GiB",
                 *args]) == 0
    path = tmp_path / "node.toml"
    path.write_text(capsys.readouterr().out)
    return load_config(path)


def test_a_llama_tp2_rank_page_is_k_and_v_of_its_heads(tmp_path, capsys):
    config = _config(tmp_path, capsys, LLAMA, "--tp-size", "2", "--page-size", "64")
    per_blob = 32 * 64 * 4 * 128 * 2  # layers x page x heads/TP x head_dim x bf16
    assert config.kv.page_bytes == (per_blob, per_blob)
    assert config.world_size == 1 and config.kv.block_tokens == 64
    assert config.region.attachments_per_rank >= 2  # every TP rank process attaches rank 0


def test_fp8_halves_the_page_and_mla_is_one_latent_blob(tmp_path, capsys):
    fp8 = _config(tmp_path, capsys, LLAMA, "--kv-cache-dtype", "fp8_e4m3")
    assert fp8.kv.page_bytes == (32 * 64 * 8 * 128,) * 2
    mla = _config(tmp_path, capsys, DEEPSEEK, "--tp-size", "8")
    assert mla.kv.page_bytes == (61 * 64 * (512 + 64) * 2,)  # the same on every rank


def test_bad_options_name_what_is_allowed(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    with pytest.raises(ConfigError, match="do not split evenly"):
        shape_from_hf_config(str(tmp_path)).pool(page_size=64, tp_size=3)
    with pytest.raises(ConfigError, match="allowed auto"):
        shape_from_hf_config(str(tmp_path), "float16")
    assert main(["config-for-sglang", str(tmp_path / "missing"), "--name", "n",
                 "--capacity", "1GiB"]) == 1
    assert "does not exist" in capsys.readouterr().err


def test_a_real_sglang_pool_fits_the_printed_config_and_another_is_refused_by_name(
        tmp_path, capsys, instance_name):
    try:
        version("sglang")
    except PackageNotFoundError:
        pytest.skip("SGLang is installed only in .venv-sglang")
    from sglang_harness import ModelSpec, SGLangRank
    from tiercache.service.process import CoordinatorProcess

    model = ModelSpec(layers=2, heads=2, head_dim=64)
    hf = {"num_hidden_layers": 2, "num_attention_heads": 2, "hidden_size": 128,
          "torch_dtype": "bfloat16"}
    config = _config(tmp_path, capsys, hf, "--page-size", "16")
    served = dataclasses.replace(config, name=instance_name,
                                 control_socket=str(tmp_path / "c.sock"),
                                 exporter=ExporterConfig(port=0))
    with CoordinatorProcess(served, workdir=tmp_path / "coord") as coordinator:
        rank = SGLangRank(str(coordinator.config_path), model=model)
        try:
            assert rank.backup(list(range(32))) == 32
            assert rank.prefetch(list(range(32))) == (32, [])  # every page exact
        finally:
            rank.close()
        wrong = SGLangRank.__new__(SGLangRank)  # an engine of twice the page size
        with pytest.raises(LayoutMismatchError) as refused:
            SGLangRank.__init__(wrong, str(coordinator.config_path),
                                model=ModelSpec(layers=4, heads=2, head_dim=64))
    message = str(refused.value)
    assert "engine 32768" in message and "region 16384" in message  # both sides
    assert "page_bytes = [16384, 16384]" in message and "block_tokens = 16" in message
    assert RegionLayout.from_config(config).row_payload_bytes == 16384
