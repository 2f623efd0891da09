"""Config parsing: defaults, both KV forms, and one clear error per bad input."""

import re
import tomllib
from pathlib import Path

import pytest

from tiercache.errors import ConfigError
from tiercache.config import (
    BackendKind, Config, PinningPolicy, config_from_dict, config_keys,
    config_to_toml, load_config,
)
from tiercache.sizes import format_bytes, parse_size

REPO = Path(__file__).resolve().parents[1]


def test_default_config_file_loads_and_describes_a_cpu_friendly_instance():
    cfg = load_config(REPO / "configs" / "default.toml")
    assert cfg.name == "default" and cfg.world_size == 2
    assert cfg.kv.page_bytes == (16 * 8 * 128 * 2,) * 8  # 4 layers x K,V
    assert cfg.region.pinning is PinningPolicy.ALLOW_UNPINNED
    assert cfg.backend is BackendKind.AUTO
    assert cfg.exporter.address == "127.0.0.1"


@pytest.mark.parametrize("text,expected", [
    ("8GiB", 8 << 30), ("512 MiB", 512 << 20), ("1.5GB", 1_500_000_000), ("4096", 4096),
    (123, 123), ("2kb", 2000),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("num_bytes,text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.00 KiB"), (3 << 29, "1.50 GiB"), (5 << 40, "5.00 TiB"),
    (1 << 52, "4096.00 TiB"),
])
def test_format_bytes(num_bytes, text):
    assert format_bytes(num_bytes) == text


@pytest.mark.parametrize("bad", ["8 parsecs", "-1", "GiB", True, -5, ""])
def test_parse_size_rejects(bad):
    with pytest.raises(ConfigError, match="expected a byte count|must be >= 0"):
        parse_size(bad, "region.capacity")


@pytest.mark.parametrize("raw,message", [
    ({"regoin": {}}, r"unknown section \[regoin\]; allowed: instance, region"),
    ({"region": {"capacty": "1GiB"}}, r"unknown key region.capacty; allowed in \[region\]: capacity"),
    ({"instance": {"world_size": "two"}}, r"instance.world_size = 'two': expected an integer"),
    ({"instance": {"world_size": True}}, r"instance.world_size = True: expected an integer"),
    ({"instance": {"world_size": 0}}, r"instance.world_size = 0: allowed 1..64"),
    ({"instance": {"name": "../etc"}}, r"instance.name = '../etc'"),
    ({"region": {"pinning": "sometimes"}}, r"region.pinning = 'sometimes': allowed 'required', "
                                           r"'allow_unpinned'"),
    ({"transfer": {"backend": "magic"}}, r"transfer.backend = 'magic': allowed 'auto', 'ce'"),
    ({"region": {"capacity": "1GiB", "num_blocks": 4}}, r"either region.capacity or region.num_blocks"),
    ({"region": {"prefault_threads": 0}}, r"region.prefault_threads = 0: allowed 1..256"),
    ({"kv": {"num_layers": 2}}, r"kv: missing kv.num_kv_heads, kv.head_dim, kv.dtype"),
    ({"kv": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 8, "dtype": "float64"}},
     r"kv.dtype = 'float64': allowed float32"),
    ({"kv": {"page_bytes": 0}}, r"kv.page_bytes\[0\] = 0: must be a positive byte count"),
    ({"kv": {"page_bytes": "4KiB", "num_layers": 2}}, r"either page_bytes"),
    ({"kv": {"page_bytes": [4096, 8192], "num_tensors": 3}}, r"kv.num_tensors = 3 but kv.page_bytes lists 2"),
    ({"kv": {"page_bytes": 4096, "block_size_factor": 0}}, r"kv.block_size_factor = 0: must be >= 1"),
    ({"kv": {"page_bytes": 4096, "num_tensors": -2}}, r"kv.num_tensors = -2: must be >= 1"),
    ({"kv": {"num_layers": 2, "num_kv_heads": 1, "head_dim": 8, "dtype": "int8",
             "num_tensors": 5}}, r"kv.num_tensors = 5 goes with kv.page_bytes"),
    ({"kv": {"page_bytes": 4096, "kv_tensors_per_layer": 1}},
     r"kv.kv_tensors_per_layer = 1 belongs to the model shape"),
    ({"exporter": {"port": 70000}}, r"exporter.port = 70000: allowed 0..65535"),
    ({"index": {"policy": "fifo"}}, r"index.policy = 'fifo': allowed 'lru', 'arc'"),
    ({"transfer": {"zero_copy_bytes": "65MiB"}},
     r"transfer.zero_copy_bytes = 68157440: allowed 0 \(never\) .. 64 MiB"),
    ({"transfer": {"zero_copy_bytes": -1}}, r"transfer.zero_copy_bytes"),
])
def test_bad_config_names_key_value_and_what_is_allowed(raw, message):
    with pytest.raises(ConfigError, match=message):
        config_from_dict(raw)


def test_model_shape_gives_one_page_per_layer_and_kv_tensor():
    cfg = config_from_dict({"kv": {"num_layers": 32, "num_kv_heads": 8, "head_dim": 128,
                                   "dtype": "bfloat16", "block_tokens": 16,
                                   "kv_tensors_per_layer": 2, "block_size_factor": 4}})
    assert cfg.kv.page_bytes == (32 << 10,) * 64
    assert cfg.kv.cpu_page_bytes == (128 << 10,) * 64


def test_missing_and_invalid_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[region\ncapacity = 1")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(bad)
    garbage = tmp_path / "garbage.toml"
    garbage.write_bytes(b"\xff\xfe\x00binary\x80")
    with pytest.raises(ConfigError, match="is not UTF-8 text"):
        load_config(garbage)
    with pytest.raises(ConfigError, match="is a directory"):
        load_config(tmp_path)


def test_defaults_live_in_the_dataclasses_only():
    """An empty file and the dataclasses' defaults agree (the parser adds none of its own)."""
    assert config_from_dict({}) == Config()
    only_blocks = config_from_dict({"region": {"num_blocks": 8}})
    assert only_blocks.region.capacity_bytes is None and only_blocks.region.num_blocks == 8


def test_toml_round_trip_preserves_every_field(make_config):
    cfg = make_config(world_size=3, zero_copy_bytes=2 << 20)
    assert config_from_dict(tomllib.loads(config_to_toml(cfg))) == cfg
    assert config_from_dict(tomllib.loads(config_to_toml(Config()))) == Config()


def test_readme_config_reference_lists_exactly_the_allowed_keys():
    readme = (REPO / "README.md").read_text()
    reference = readme.split("## Config reference", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"`([a-z_]+\.[a-z_]+)`", reference))
    allowed = {f"{section}.{key}" for section, keys in config_keys().items() for key in keys}
    assert documented == allowed


def test_index_policies_match_the_policy_registry():
    from tiercache.config import INDEX_POLICIES
    from tiercache import eviction as policies

    assert set(INDEX_POLICIES) == set(policies.POLICIES)


def test_a_relative_control_socket_is_resolved_once(tmp_path, monkeypatch):
    """From a file: against the file's directory; in code: against the current directory
    when the Config is built. Either way a later chdir changes nothing."""
    (tmp_path / "conf").mkdir()
    (tmp_path / "elsewhere").mkdir()
    path = tmp_path / "conf" / "c.toml"
    path.write_text('[control]\nsocket = "run/ctl.sock"\n')
    monkeypatch.chdir(tmp_path / "elsewhere")
    from_file = load_config(path)
    in_code = Config(control_socket="ctl.sock")
    monkeypatch.chdir(tmp_path)
    assert from_file.socket_path == str(tmp_path / "conf" / "run" / "ctl.sock")
    assert in_code.socket_path == str(tmp_path / "elsewhere" / "ctl.sock")
    assert load_config("conf/c.toml") == from_file  # the file's own path may be relative
    absolute = str(tmp_path / "abs.sock")
    assert config_from_dict({"control": {"socket": absolute}}, base_dir=tmp_path / "conf") \
        .socket_path == absolute


def test_the_disk_section_is_optional_checked_and_round_trips(tmp_path):
    from tiercache.config import config_to_toml, load_config

    assert config_from_dict({}).disk is None  # no section: host memory only
    (tmp_path / "d").mkdir()
    cfg = tmp_path / "c.toml"
    cfg.write_text('[disk]\npath = "d"\ncapacity = "1MiB"\nretry_s = 2\ndirect_io = false\n')
    config = load_config(cfg)
    assert config.disk.path == str(tmp_path / "d")  # relative to the config file
    assert (config.disk.capacity_bytes, config.disk.retry_s, config.disk.direct_io) == \
        (1 << 20, 2.0, False)
    again = tmp_path / "again.toml"
    again.write_text(config_to_toml(config))
    assert load_config(again) == config
    # a config is written before the node's directory exists (config-for-vllm --disk-path):
    # the directory is a start-up check of `serve` (tiers/disk_claim), not of the file
    assert config_from_dict({"disk": {"path": str(tmp_path / "nope"), "capacity": 1}}
                            ).disk.path == str(tmp_path / "nope")
    for body, message in (
            ({"path": str(tmp_path / "d")}, "disk.capacity is missing"),
            ({"capacity": "1MiB"}, "disk.path is missing"),
            ({"path": str(tmp_path / "d"), "capacity": 0}, "disk.capacity = 0"),
            ({"path": str(tmp_path / "d"), "capacity": 1, "direct_io": "maybe"},
             "disk.direct_io = 'maybe'"),
            ({"path": str(tmp_path / "d"), "capacity": 1, "low_watermark": 1},
             "disk.low_watermark = 1"),
            ({"path": str(tmp_path / "d"), "capacity": 1, "speed": 1}, "unknown key disk.speed")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            config_from_dict({"disk": body})


def test_the_cluster_section_is_optional_checked_and_round_trips(tmp_path):
    from tiercache.config import config_to_toml, load_config

    assert config_from_dict({}).cluster is None  # no section: this node's tiers only
    cfg = tmp_path / "c.toml"
    cfg.write_text('[cluster]\nmaster = "10.0.0.1:50051"\n'
                   'metadata_server = "http://10.0.0.1:8080/metadata"\n'
                   'local_hostname = "10.0.0.2"\nkey_file = "cluster.key"\n'
                   'segment_size = "8GiB"\nexists_ttl_s = 2\n'
                   'publish_threads = 6\nstop_timeout_s = 3\ncensus_period_s = 300\n')
    config = load_config(cfg)
    c = config.cluster
    assert (c.backend, c.segment_bytes, c.exists_ttl_s, c.protocol, c.replicas) == \
        ("mooncake", 8 << 30, 2.0, "tcp", 1)
    assert (c.publish_threads, c.promote_threads, c.stop_timeout_s) == (6, 2, 3.0)
    assert c.census_period_s == 300.0
    assert c.key_file == str(tmp_path / "cluster.key")  # beside the config file
    again = tmp_path / "again.toml"
    again.write_text(config_to_toml(config))
    assert load_config(again) == config
    good = {"master": "m:1", "metadata_server": "http://m:2/metadata", "local_hostname": "h",
            "key_file": "/etc/tiercache/cluster.key"}
    for change, message in (
            ({"master": None}, "cluster.master is missing"),
            ({"key_file": None}, "cluster.key_file is missing: the nodes of a cluster sign"),
            ({"local_hostname": "256.1.1.1"}, "cluster.local_hostname = '256.1.1.1': not an "
                                              "IPv4 address"),
            ({"local_hostname": None}, "cluster.local_hostname is missing"),
            ({"master": "m"}, "cluster.master = 'm': expected host:port"),
            ({"master": "m:99999"}, "the port must be 1..65535"),
            ({"metadata_server": "m:2"}, "cluster.metadata_server = 'm:2'"),
            ({"local_hostname": "h:x"}, "cluster.local_hostname = 'h:x'"),
            ({"backend": "redis"}, "cluster.backend = 'redis': allowed 'mooncake'"),
            ({"protocol": "udp"}, "cluster.protocol = 'udp'"),
            ({"segment_size": "1KiB"}, "cluster.segment_size = 1024"),
            ({"replicas": 0}, "cluster.replicas = 0"),
            ({"publish_queue_blocks": 0}, "cluster.publish_queue_blocks = 0"),
            ({"exists_ttl_s": 0}, "cluster.exists_ttl_s = 0"),
            ({"exists_wait_s": 0}, "cluster.exists_wait_s = 0"),
            ({"start_timeout_s": -1}, "cluster.start_timeout_s = -1"),
            ({"stop_timeout_s": 0}, "cluster.stop_timeout_s = 0"),
            ({"census_period_s": 0}, "cluster.census_period_s = 0"),
            ({"publish_threads": 0}, "cluster.publish_threads = 0: allowed 1..64"),
            ({"promote_threads": 65}, "cluster.promote_threads = 65: allowed 1..64"),
            ({"port": 1}, "unknown key cluster.port")):
        body = {**good, **change}
        body = {key: value for key, value in body.items() if value is not None}
        with pytest.raises(ConfigError, match=re.escape(message)):
            config_from_dict({"cluster": body})


def test_zero_copy_is_off_by_default_and_takes_a_size():
    assert Config().zero_copy_bytes == 0
    assert config_from_dict({"transfer": {"zero_copy_bytes": "2MiB"}}).zero_copy_bytes == 2 << 20
