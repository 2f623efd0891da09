"""`tiercache config-for-sglang` over the model matrix (docs/sglang.md, "Models"): the page it
prints is the one SGLang 0.5.23's host pool hands the backend, or the model is refused in one
line; the printed config serves SGLang's real HiCache controller, every page exact.

The models are their published config.json files (tests/fixtures/models); the expected
pages are the cards' arithmetic, independent of the code under test: K and V blobs of
``layers x page x kv_heads/TP x head_dim`` elements (``page_first*``; ``layer_first`` one
blob per layer and K/V), MLA one latent blob of ``layers x page x (kv_lora_rank +
qk_rope_head_dim)``.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path

import pytest

from sglang_env import STUBS, require_sglang

require_sglang()

from tiercache.cli import main  # noqa: E402
from tiercache.config import load_config  # noqa: E402
from tiercache.errors import LayoutMismatchError  # noqa: E402
from tiercache.region.layout import RegionLayout  # noqa: E402

MODELS = Path(__file__).parents[1] / "fixtures" / "models"
BF16, FP8 = 2, 1


def mha(layers, kv_heads, head_dim, tp=1, page=64, itemsize=BF16):
    blob = layers * page * max(1, kv_heads // tp) * head_dim * itemsize
    return [blob, blob]


def mla(layers, page=64, itemsize=BF16):
    return [layers * page * (512 + 64) * itemsize]


SERVED = [
    ("Llama-3.1-8B-Instruct", [], mha(32, 8, 128)),
    ("Llama-3.1-8B-Instruct", ["--tp-size", "2"], mha(32, 8, 128, tp=2)),
    ("Llama-3.1-8B-Instruct", ["--kv-cache-dtype", "fp8_e4m3"], mha(32, 8, 128, itemsize=FP8)),
    ("Llama-3.1-8B-Instruct", ["--page-size", "16"], mha(32, 8, 128, page=16)),
    ("Qwen3-8B", ["--tp-size", "4"], mha(36, 8, 128, tp=4)),
    ("DeepSeek-V2-Lite", [], mla(27)),
    ("DeepSeek-V3", ["--tp-size", "8"], mla(61)),  # the same latent on every rank
    ("DeepSeek-V3", ["--kv-cache-dtype", "fp8_e4m3"], mla(61, itemsize=FP8)),
    ("gemma-3-12b-it", [], mha(48, 8, 256)),  # SGLang runs Gemma 3 on one full pool
]
REFUSED = [
    ("gpt-oss-20b", "GptOssForCausalLM: SGLang 0.5.23 runs it on hybrid pools (sliding-window"),
    ("Qwen3-Next-80B-A3B-Instruct", "Qwen3NextForCausalLM: SGLang 0.5.23 runs it on hybrid "
                                    "pools (Mamba"),
    ("Nemotron-H-8B-Base-8K", "NemotronHForCausalLM: SGLang 0.5.23 runs it on hybrid pools "
                              "(Mamba"),
]


@pytest.fixture(autouse=True)
def stubs_for_children(monkeypatch):
    """transformers' and SGLang's model inspection may run in a child: the stubs there too."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [STUBS, os.environ.get(
        "PYTHONPATH")])))


@pytest.fixture
def config_for_sglang(capsys):
    def run(model: str, *args: str) -> tuple[int, str, str]:
        capsys.readouterr()
        status = main(["config-for-sglang", str(MODELS / model), *args])
        out = capsys.readouterr()
        return status, out.out, out.err

    return run


@pytest.mark.parametrize("model, flags, pages", SERVED,
                         ids=[m + "".join(f) for m, f, _ in SERVED])
def test_the_printed_page_is_the_model_cards(config_for_sglang, model, flags, pages):
    status, out, err = config_for_sglang(model, "--name", "node", "--capacity", "1GiB", *flags)
    assert status == 0, err
    printed = tomllib.loads(out)
    assert printed["kv"]["page_bytes"] == pages
    assert printed["instance"]["world_size"] == 1  # every TP rank process attaches rank 0
    assert printed["region"]["pinning"] == "required" and printed["region"]["capacity"] == "1GiB"


def test_layer_first_is_one_blob_per_layer_and_k_or_v(config_for_sglang, tmp_path):
    status, out, err = config_for_sglang("Llama-3.1-8B-Instruct", "--name", "node", "--capacity",
                                         "1GiB", "--hicache-mem-layout", "layer_first")
    assert status == 0, err
    path = tmp_path / "node.toml"
    path.write_text(out)
    # the region holds the page as K and V halves; its payload is every layer's blobs
    assert RegionLayout.from_config(load_config(path)).row_payload_bytes == \
        64 * 64 * 8 * 128 * BF16


@pytest.mark.parametrize("model, reason", REFUSED, ids=[m for m, _ in REFUSED])
def test_models_on_hybrid_pools_are_refused_in_one_line(config_for_sglang, model, reason):
    status, out, err = config_for_sglang(model, "--name", "node", "--capacity", "1GiB")
    assert status == 1 and out == ""
    assert err.startswith(f"tiercache: error: {reason}") and err.count("\n") == 1, err


def test_bad_options_name_what_is_allowed(config_for_sglang, tmp_path):
    status, _, err = config_for_sglang("Llama-3.1-8B-Instruct", "--name", "n", "--capacity",
                                       "1GiB", "--tp-size", "3")
    assert status == 1 and "8 KV heads do not split evenly over --tp-size 3" in err
    status, _, err = config_for_sglang("Llama-3.1-8B-Instruct", "--name", "n", "--capacity",
                                       "1GiB", "--disk-path", "/var/cache/tiercache")
    assert status == 1 and "--disk-path and --disk-capacity go together" in err
    assert main(["config-for-sglang", str(tmp_path / "missing"), "--name", "n",
                 "--capacity", "1GiB"]) == 1


@pytest.mark.parametrize("model, spec", [
    ("Llama-3.1-8B-Instruct", dict(layers=32, heads=8, head_dim=128)),
    ("DeepSeek-V2-Lite", dict(layers=27, mla=True, kv_lora_rank=512, rope_dim=64)),
])
def test_the_printed_config_serves_sglangs_controller_and_refuses_another_page(
        config_for_sglang, tmp_path, instance_name, model, spec):
    from sglang_harness import ModelSpec, SGLangRank
    from tiercache.service.process import CoordinatorProcess

    status, out, err = config_for_sglang(model, "--name", instance_name, "--capacity", "64MiB",
                                         "--page-size", "16", "--socket",
                                         str(tmp_path / "c.sock"), "--pinning", "allow_unpinned",
                                         "--exporter-port", "0")
    assert status == 0, err
    printed = tmp_path / "node.toml"
    printed.write_text(out)
    config = load_config(printed)
    shape = ModelSpec(name=model, page_size=16, **spec)
    with CoordinatorProcess(config, workdir=tmp_path / "coord"):
        rank = SGLangRank(str(printed), model=shape, device_tokens=256)
        try:
            assert rank.backup(list(range(64))) == 64
            assert rank.prefetch(list(range(64))) == (64, [])  # every page exact
        finally:
            rank.close()
        wrong = SGLangRank.__new__(SGLangRank)  # an engine of another page
        with pytest.raises(LayoutMismatchError) as refused:
            SGLangRank.__init__(wrong, str(printed), model=dataclasses.replace(shape, layers=2),
                                device_tokens=256)
    page = RegionLayout.from_config(config).row_payload_bytes
    assert f"region {page}" in str(refused.value)  # both sides named
