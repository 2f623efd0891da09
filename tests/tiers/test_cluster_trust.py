"""The cluster tier against a pool peer that is not one of the cluster's nodes: a real
``mooncake_master`` on loopback, real coordinators as nodes, and a second Mooncake client
in a process of its own as the rogue peer (it reaches the pool, as anyone on the pool's
network does, but not ``cluster.key_file``).

* the node's region is not reachable through the pool: the rogue's transfer engine
  reading or writing a READY block's row at the coordinator's mapping is refused, and the
  block loads exact (before: read and overwritten, served as a host hit);
* objects the rogue puts under tiercache's names (whole headers, recomputed CRCs, its own
  key or none) are never served: misses, counted checksum failures;
* the rogue upserting over a node's published objects: the other node never serves them;
* a ``[cluster]`` key file another user could read or replace is refused at start, in
  one line.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from control_children import block_pattern
from control_support import wait_for
from mooncake_master import make_key_file
from users import other_user
from test_cluster_tier import KEYS, cluster_stats, load, master, start_node, store  # noqa: F401
from tiercache.config import ClusterConfig
from tiercache.link.client import Client
from tiercache.errors import ConfigError, ServiceError
from tiercache.region.layout import RegionLayout
from tiercache.region.shared import SharedOffloadRegion
from tiercache.tiers.block_header import BlockMac
from tiercache.tiers.cluster_key import load_cluster_key
from tiercache.tiers.cluster_object import HEADER_BYTES, BlockFormat

ROGUE = """
import ctypes, mmap, os, sys
os.environ["GLOG_minloglevel"] = "3"
mode, metadata = sys.argv[1], sys.argv[2]
if mode == "engine":  # read, then write, 4 KiB at a node's address
    from mooncake.engine import TransferEngine
    target, address = sys.argv[3], int(sys.argv[4])
    engine = TransferEngine()
    assert engine.initialize("127.0.0.1", metadata, "tcp", "") == 0
    mine = mmap.mmap(-1, 4096)
    at = ctypes.addressof(ctypes.c_char.from_buffer(mine))
    assert engine.register_memory(at, 4096) == 0
    read = engine.transfer_sync_read(target, at, address, 4096)
    mine[:] = b"\\xee" * 4096
    write = engine.transfer_sync_write(target, at, address, 4096)
    print("answers", read, write, flush=True)
    sys.stdin.read()
else:  # put or upsert the objects in a file: names, then the objects' bytes
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig
    master, size, names = sys.argv[3], int(sys.argv[4]), sys.argv[6:]
    data = open(sys.argv[5], "rb").read()
    store = MooncakeDistributedStore()
    assert store.setup("127.0.0.1", metadata, 16 << 20, 16 << 20, "tcp", "", master) == 0
    buf = mmap.mmap(-1, len(data))
    buf[:] = data
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    assert store.register_buffer(base, len(buf)) == 0
    call = store.batch_put_from if mode == "put" else store.batch_upsert_from
    codes = call(names, [base + i * size for i in range(len(names))], [size] * len(names),
                 ReplicateConfig())
    print("answers", *codes, flush=True)
    sys.stdin.read()  # the objects live in this client's segment: kept while it runs
os._exit(0)
"""


@pytest.fixture
def rogue():
    """``rogue(*args)`` -> the rogue peer's answers: a process of its own, a Mooncake client
    of the pool, kept running (with what it put in its segment) until the test ends."""
    running: list[subprocess.Popen] = []

    def run(*args: str) -> list[int]:
        proc = subprocess.Popen([sys.executable, "-c", ROGUE, *args], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        running.append(proc)
        line = proc.stdout.readline()
        assert line.startswith("answers"), f"the rogue peer failed (exit {proc.wait(60)})"
        return [int(x) for x in line.split()[1:]]
    yield run
    for proc in running:
        proc.stdin.close()
        proc.wait(60)


def segment_of(node) -> str:
    """The node's segment in the pool, ``host:port``, from its start line."""
    line = next(x for x in node.output().splitlines() if "this node's segment" in x)
    return line.split(" at ", 1)[1].split(" ", 1)[0]


def mapping_base(pid: int, shm_name: str) -> int:
    """Where process ``pid`` maps the region ``/dev/shm/<shm_name>`` (its lowest address)."""
    with open(f"/proc/{pid}/maps") as maps:
        starts = [int(line.split("-", 1)[0], 16) for line in maps
                  if line.rstrip().endswith(f"/dev/shm/{shm_name}")]
    assert starts, f"pid {pid} does not map {shm_name}"
    return min(starts)


def test_the_region_is_not_reachable_through_the_pool(start_node, master, rogue):
    a = start_node("a")
    assert store(a, KEYS[:2])
    with SharedOffloadRegion.attach(a.config.name) as region, Client(a.config) as client:
        slot = int(client.lease(KEYS[:1]).spec.block_ids[0])
        client.release(KEYS[:1])
        row = region.rank_array(0)[slot]
        offset = row.ctypes.data - region.base_address
    target = mapping_base(a.pid, a.config.shm_name) + offset  # the row in the coordinator
    read, write = rogue("engine", master.metadata_url, segment_of(a), str(target))
    assert read != 0 and write != 0  # refused: no registered buffer there
    assert load(a, KEYS[:2])[:2] == (2, 0)  # a host hit, exact


def rogue_objects(fmt: BlockFormat, keys: list[bytes], how: str) -> bytes:
    """Whole objects for ``keys`` (every rank) with another key's bytes in their rows:
    signed with the rogue's own key, or a real header made to fit (a recomputed CRC)."""
    from tiercache.tiers.block_header import HEADER_BYTES as SIGNED_BYTES
    from tiercache.tiers.block_header import BlockHeader, Container, checksum

    rogue_fmt = BlockFormat(fmt.world_size, fmt.row_stride, fmt.page_bytes,
                            fmt.block_size_factor, BlockMac(os.urandom(32)))
    out = bytearray()
    for key in keys:
        for rank in range(fmt.world_size):
            row = block_pattern(b"rogue-" + key, rank, fmt.row_stride).tobytes()
            head = bytearray(rogue_fmt.header(key, rank, row).ljust(HEADER_BYTES, b"\0"))
            if how == "recomputed CRC":
                real = BlockHeader.decode(bytes(head), Container.POOL_OBJECT)
                head[:SIGNED_BYTES] = BlockHeader(
                    real.container, real.format, real.instance, real.seq, real.rank,
                    real.world_size, real.data_bytes, checksum([row]), real.key).encode()
                head[SIGNED_BYTES:SIGNED_BYTES + 32] = bytes(32)
            out += head + row
    return bytes(out)


@pytest.mark.parametrize("how", ["its own key", "recomputed CRC"])
def test_objects_a_rogue_puts_under_tiercaches_names_are_never_served(start_node, master,
                                                                      rogue, tmp_path, how):
    b = start_node("b")
    fmt = BlockFormat.of(RegionLayout.from_config(b.config), load_cluster_key(master.key_file))
    keys = KEYS[:4]
    data = tmp_path / "rogue.bin"
    data.write_bytes(rogue_objects(fmt, keys, how))
    names = [fmt.name(key, rank) for key in keys for rank in range(fmt.world_size)]
    assert rogue("put", master.metadata_url, master.address, str(fmt.object_bytes),
                 str(data), *names) == [0] * len(names)
    for key in keys:  # each asked alone: each is read from the pool and checked
        exact, wrong, answers = load(b, [key])
        assert (exact, wrong, answers[-1].num_hit) == (0, 0, 0)
    stats = wait_for(lambda: (s := cluster_stats(b)).checksum_failures == len(keys) and s,
                     "node b reads and refuses every object")  # (a lookup may miss first)
    assert stats.promotions == 0 and stats.up


def test_a_rogue_upserting_over_a_nodes_objects_is_never_served(start_node, master, rogue,
                                                                tmp_path):
    a, b = start_node("a"), start_node("b")
    keys = KEYS[:4]
    assert store(a, keys)
    fmt = BlockFormat.of(RegionLayout.from_config(a.config), load_cluster_key(master.key_file))
    data = tmp_path / "rogue.bin"
    data.write_bytes(rogue_objects(fmt, keys, "recomputed CRC"))
    names = [fmt.name(key, rank) for key in keys for rank in range(fmt.world_size)]
    assert rogue("upsert", master.metadata_url, master.address, str(fmt.object_bytes),
                 str(data), *names) == [0] * len(names)
    for key in keys:
        exact, wrong, answers = load(b, [key])
        assert (exact, wrong, answers[-1].num_hit) == (0, 0, 0)
    wait_for(lambda: cluster_stats(b).checksum_failures == len(keys),
             "node b reads and refuses every object")
    assert cluster_stats(b).promotions == 0
    assert load(a, keys)[:2] == (len(keys), 0)  # a's own host copies are untouched


def test_a_cluster_section_without_a_usable_key_file_is_refused(make_config, master, tmp_path):
    with pytest.raises(ConfigError, match=r"cluster.key_file is missing: .*head -c 32 "
                                          r"/dev/urandom > KEY && chmod 600 KEY"):
        ClusterConfig(master=master.address, metadata_server=master.metadata_url,
                      local_hostname="127.0.0.1")
    loose = make_key_file(tmp_path / "loose.key")
    os.chmod(loose, 0o640)
    short = tmp_path / "short.key"
    short.write_bytes(b"x" * 16)
    os.chmod(short, 0o600)
    fifo = tmp_path / "fifo.key"
    os.mkfifo(fifo, 0o600)
    for path, why in ((loose, "mode 0640"), (short, "holds 16 bytes"), (fifo, "a FIFO"),
                      (tmp_path / "none.key", "cannot open it")):
        with pytest.raises(ConfigError, match=why):
            load_cluster_key(str(path))
    config = make_config(cluster=ClusterConfig(
        master=master.address, metadata_server=master.metadata_url,
        local_hostname="127.0.0.1", key_file=str(loose), start_timeout_s=5))
    from tiercache.service.process import CoordinatorProcess

    with pytest.raises(ServiceError) as failed:
        CoordinatorProcess(config, tmp_path / "node")
    assert "cluster.key_file" in str(failed.value) and "mode 0640" in str(failed.value)


@pytest.fixture
def other():
    yield from other_user()


def test_a_key_file_of_another_user_is_refused(other, tmp_path):
    theirs = make_key_file(tmp_path / "theirs.key")
    other.own(theirs)
    with pytest.raises(ConfigError, match=f"owned by {other.name}"):
        load_cluster_key(str(theirs))
    link = tmp_path / "link.key"  # a symlink is judged by what it leads to
    link.symlink_to(theirs)
    with pytest.raises(ConfigError, match=f"owned by {other.name}"):
        load_cluster_key(str(link))


def failed_start(make_config, tmp_path, master, **cluster) -> str:
    """The output of ``tiercache serve`` refusing to start with these ``[cluster]`` values
    (the test master's addresses unless given)."""
    from tiercache.service.process import CoordinatorProcess

    fields = dict(master=master.address, metadata_server=master.metadata_url,
                  local_hostname="127.0.0.1", key_file=master.key_file, start_timeout_s=1)
    config = make_config(cluster=ClusterConfig(**{**fields, **cluster}))
    with pytest.raises(ServiceError) as failed:
        CoordinatorProcess(config, tmp_path / "node")
    return str(failed.value)


def mooncake_log_lines(output: str) -> list[str]:
    """glog's lines (``E1127 23:33:37.451901 22357 file.cpp:292] ...``)."""
    return [line for line in output.splitlines()
            if len(line) > 5 and line[0] in "IWEF" and line[1:5].isdigit()]


def test_an_unreachable_metadata_server_is_one_line_without_mooncakes_log(make_config,
                                                                         tmp_path, master):
    from mooncake_master import free_port

    url = f"http://127.0.0.1:{free_port()}/metadata"
    out = failed_start(make_config, tmp_path, master, metadata_server=url)
    assert f"cluster.metadata_server = {url!r}: no metadata server answers there (waited " \
           "1 s, cluster.start_timeout_s)" in out
    assert mooncake_log_lines(out) == []  # before: 321 lines of Mooncake's retries


@pytest.mark.parametrize("cluster, line", [
    ({"protocol": "rdma"}, "cluster.protocol = 'rdma', but this host has no RDMA device"),
    ({"local_hostname": "no-such-host.invalid"},
     "cluster.local_hostname = 'no-such-host.invalid': does not resolve to an address"),
])
def test_a_node_mooncake_would_start_and_never_transfer_with_is_refused(
        make_config, tmp_path, master, cluster, line):
    if cluster.get("protocol") == "rdma" and os.path.isdir("/sys/class/infiniband") \
            and os.listdir("/sys/class/infiniband"):
        pytest.skip("this host has RDMA devices")
    out = failed_start(make_config, tmp_path, master, **cluster)
    assert line in out and "ready" not in out
    assert mooncake_log_lines(out) == []


def test_a_local_hostname_that_is_no_ipv4_address_is_refused_in_the_config():
    with pytest.raises(ConfigError, match="cluster.local_hostname = '256.1.1.1': not an IPv4"):
        ClusterConfig(master="127.0.0.1:1", metadata_server="http://127.0.0.1:2/metadata",
                      local_hostname="256.1.1.1", key_file="k")
