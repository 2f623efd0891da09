"""`tiercache config-for-vllm`: what it prints besides the geometry (the node's flags), and its
errors. The geometry of each model family: test_model_matrix.py."""

from __future__ import annotations

import json
import tomllib

from vllm_env import require_vllm

require_vllm()

import pytest  # noqa: E402

from tiercache.cli import main  # noqa: E402
from tiercache.config import config_from_dict, load_config  # noqa: E402
from test_model_matrix import MODELS  # noqa: E402

LLAMA = str(MODELS / "Llama-3.1-8B-Instruct")


def run(capsys, *args: str) -> tuple[int, str, str]:
    capsys.readouterr()
    status = main(["config-for-vllm", *args])
    out = capsys.readouterr()
    return status, out.out, out.err


def test_the_nodes_flags_make_a_file_serve_runs_as_is(capsys, tmp_path):
    key = tmp_path / "cluster.key"
    status, out, err = run(
        capsys, LLAMA, "--name", "node", "--capacity", "256GiB", "-tp", "2",
        "--socket", "/run/tiercache/node/tiercache-node.sock", "--exporter-address", "0.0.0.0",
        "--disk-path", "/var/cache/tiercache", "--disk-capacity", "1TiB",
        "--events-endpoint", "tcp://*:5557", "--events-replay-endpoint", "tcp://*:5558",
        "--cluster-master", "master:50051", "--cluster-metadata-server",
        "http://master:8080/metadata", "--cluster-local-hostname", "@POD_IP@",
        "--cluster-key-file", str(key), "--cluster-segment-size", "16GiB")
    assert status == 0, err
    printed = tomllib.loads(out)
    assert printed["region"]["capacity"] == "256GiB" and printed["instance"]["world_size"] == 2
    assert printed["region"]["pinning"] == "required"  # a node service pins or fails
    assert printed["control"]["socket"] == "/run/tiercache/node/tiercache-node.sock"
    assert printed["exporter"]["address"] == "0.0.0.0"
    assert printed["disk"] == printed["disk"] | {"path": "/var/cache/tiercache",
                                                 "capacity": "1TiB"}
    assert printed["events"]["replay_endpoint"] == "tcp://*:5558"
    assert printed["cluster"]["segment_size"] == "16GiB"
    assert printed["cluster"]["local_hostname"] == "@POD_IP@"
    path = tmp_path / "node.toml"
    path.write_text(out)
    assert load_config(path) == config_from_dict(printed)  # the file loads as printed


@pytest.mark.parametrize("flags, message", [
    (["--disk-path", "/var/cache/tiercache"], "--disk-path and --disk-capacity go together"),
    (["--events-replay-endpoint", "tcp://*:5558"], "--events-replay-endpoint needs"),
    (["--cluster-master", "m:1"], "the cluster tier needs --cluster-metadata-server, "
                                  "--cluster-local-hostname, --cluster-key-file"),
    (["--capacity", "lots"], "--capacity = 'lots'"),
    (["--events-endpoint", "tcp://127.0.0.1:٥٥٥٥"], "events.endpoint"),
])
def test_a_flag_without_its_partners_is_one_line_and_prints_nothing(capsys, flags, message):
    args = ["--name", "node", "--capacity", "1GiB", *flags]
    status, out, err = run(capsys, LLAMA, *args)
    assert status == 1 and out == "" and err.count("\n") == 1 and message in err, err


def test_a_missing_or_foreign_model_config_is_one_clear_error(capsys, tmp_path):
    status, out, err = run(capsys, str(tmp_path / "nope"), "--name", "x", "--capacity", "1GiB")
    assert status == 1 and out == "" and "does not exist" in err
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "vision"}))
    status, out, err = run(capsys, str(tmp_path), "--name", "x", "--capacity", "1GiB")
    assert status == 1 and out == "" and "not a decoder config" in err
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "nonesuch", "architectures": ["NoSuchForCausalLM"],
        "num_hidden_layers": 2, "num_attention_heads": 2}))
    status, out, err = run(capsys, str(tmp_path), "--name", "x", "--capacity", "1GiB")
    assert status == 1 and out == "" and err.startswith(
        "tiercache: error: vLLM 0.33.0 cannot read the model at") and err.count("\n") == 1, err
