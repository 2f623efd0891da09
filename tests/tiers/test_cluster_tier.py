"""The cluster tier through real coordinators and a real ``mooncake_master`` on loopback:
two coordinators (own instance names, regions, sockets) stand for two nodes. What node A
stores is an exact hit on node B after promotion; a node of another geometry sees none of
it; a master killed makes B's lookups plain misses (no error) and the tier comes back with
a master; node A stopped or killed: B's lookups of A's blocks miss cleanly; an object
damaged in the pool, or a key a dead writer left stuck mid-put, is a miss, never a load;
a node stops without waiting on calls a frozen master holds; blocks promoted from a node's
disk are published, those promoted from the pool are not published again; the tier counts
the blocks this node published that the pool still holds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from control_children import block_pattern, rows_hold
from control_support import stop_process, wait_for
from e2e_support import metrics_url, sample, scrape
from mooncake_master import TRANSFER_TIMEOUT_S, MooncakeMaster, short_transfer_timeouts
from tiercache.config import ClusterConfig, DiskConfig, KVGeometry, RegionConfig
from tiercache.link.client import Client
from tiercache.results import BlockSource
from tiercache.region.layout import RegionLayout
from tiercache.region.shared import SharedOffloadRegion
from tiercache.service.process import CoordinatorProcess
from tiercache.tiers.cluster_key import load_cluster_key
from tiercache.tiers.cluster_object import BlockFormat
from tiercache.tiers.disk_file import HEADER_BYTES as DISK_HEADER_BYTES
from tiercache.tiers.mooncake_pool import OBJECT_HAS_LEASE, OBJECT_NOT_FOUND, MooncakePool

ROW = 4096
WAIT_S = 0.05  # cluster.exists_wait_s
TTL_S = 0.5  # cluster.exists_ttl_s
CENSUS_S = 2.0  # cluster.census_period_s: above the test master's lease (LEASE_TTL_MS)
KEYS = [b"cluster-key-%d" % i for i in range(24)]


@pytest.fixture
def master(tmp_path):
    with MooncakeMaster(tmp_path / "master") as m:
        yield m


@pytest.fixture
def start_node(make_config, instance_name, tmp_path, master):
    """``start(node, page=ROW)`` -> a running coordinator of its own instance, region and
    socket, with a cluster tier on ``master`` (and with ``disk``, a disk tier whose file
    outlives the coordinator: start the node again to find it); all stopped and cleaned up
    after."""
    started = []

    def start(node: str, page: int = ROW, num_blocks: int = 64,
              disk: bool = False) -> CoordinatorProcess:
        disk_config = None
        if disk:
            (tmp_path / f"disk-{node}").mkdir(exist_ok=True)
            disk_config = DiskConfig(path=str(tmp_path / f"disk-{node}"), low_watermark=0.5,
                                     capacity_bytes=64 * (DISK_HEADER_BYTES + 2 * page))
        config = make_config(
            name=f"{instance_name}{node}", control_socket=str(tmp_path / f"{node}.sock"),
            kv=KVGeometry(page_bytes=(page,)),
            region=RegionConfig(capacity_bytes=None, num_blocks=num_blocks, prefault_threads=1),
            disk=disk_config,
            cluster=ClusterConfig(master=master.address, metadata_server=master.metadata_url,
                                  local_hostname="127.0.0.1", key_file=master.key_file,
                                  segment_bytes=32 << 20,
                                  exists_ttl_s=TTL_S, exists_wait_s=WAIT_S, retry_s=0.3,
                                  census_period_s=CENSUS_S, start_timeout_s=5))
        process = CoordinatorProcess(config, tmp_path / f"node-{node}-{len(started)}")
        started.append(process)
        return process

    yield start
    for process in started:
        process.cleanup()


def cluster_stats(node: CoordinatorProcess, tier: str = "cluster"):
    with Client(node.config) as client:
        return client.tier_stats()[tier]


def drained(node: CoordinatorProcess):
    """The cluster tier's figures once nothing waits to be published (queued_blocks counts
    the publishes under way too)."""
    return wait_for(lambda: (s := cluster_stats(node)).queued_blocks == 0 and s,
                    f"node {node.config.name} publishes what it queued")


def store(node: CoordinatorProcess, keys: list[bytes], timeout_s: float = 30.0) -> bool:
    """Store ``keys`` on ``node`` (each rank's row its pattern); whether they are published
    within ``timeout_s``."""
    config = node.config
    before = cluster_stats(node).demotions
    with SharedOffloadRegion.attach(config.name) as region, Client(config) as client:
        out = client.prepare_store(keys)
        assert out is not None and list(out.keys_to_store) == keys
        stride = region.layout.row_stride
        for slot, key in zip(out.store_spec.block_ids.tolist(), keys):
            for rank in range(config.world_size):
                region.rank_array(rank)[slot] = block_pattern(key, rank, stride)
        client.complete_store(keys)
    try:
        wait_for(lambda: cluster_stats(node).demotions >= before + len(keys),
                 f"node {config.name} publishes its {len(keys)} blocks", timeout_s)
    except AssertionError:
        return False
    return True


def lease_settled(client: Client, keys: list[bytes], timeout_s: float = 30.0):
    """Lease ``keys`` (a prefix), asking again while the answer is pending; the answers."""
    answers = [client.lease(keys)]
    deadline = time.monotonic() + timeout_s
    while answers[-1].pending:
        assert time.monotonic() < deadline, f"stayed pending for {timeout_s} s"
        time.sleep(0.005)
        answers.append(client.lease(keys))
    return answers


def load_all(node: CoordinatorProcess, keys: list[bytes]) -> list:
    """Every answer of ``load``'s tries until every key is an exact hit (each try's hits
    checked byte for byte, none wrong). A promotion whose read outlives
    ``PROMOTION_WAIT_S`` (a loaded machine) is a miss by design, not a wait: the key lands
    in host memory a moment later (its source kept), so ask again until it does."""
    tries = []

    def all_hit() -> bool:
        tries.append(load(node, keys))
        return tries[-1][2][-1].num_hit == len(keys)

    wait_for(all_hit, f"node {node.config.name} brings up {len(keys)} blocks")
    assert all(wrong == 0 for _, wrong, _ in tries)
    assert tries[-1][0] == len(keys)
    return [answer for _, _, answers in tries for answer in answers]


def lease_hits(client: Client, keys: list[bytes]) -> list:
    """``lease_settled``'s answers, asked again until every key is a hit (an overdue
    promotion's miss, as in ``load_all``)."""
    answers = []

    def all_hit() -> bool:
        answers.extend(lease_settled(client, keys))
        return answers[-1].num_hit == len(keys)

    wait_for(all_hit, f"{len(keys)} leased blocks come up")
    return answers


def load(node: CoordinatorProcess, keys: list[bytes]) -> tuple[int, int, list]:
    """(exact, wrong, answers): ``keys`` leased on ``node`` as one prefix until settled,
    then every hit's rows compared with its pattern under the lease's pins."""
    with SharedOffloadRegion.attach(node.config.name) as region, Client(node.config) as client:
        answers = lease_settled(client, keys)
        final = answers[-1]
        slots = final.spec.block_ids.tolist() if final.num_hit else []
        exact = sum(rows_hold(region, slot, key) for slot, key in zip(slots, keys))
        client.release(keys[:final.num_hit])
    return exact, len(slots) - exact, answers


def test_a_block_stored_on_node_a_is_an_exact_hit_on_node_b(start_node):
    a, b = start_node("a"), start_node("b")
    assert "cluster tier: Mooncake Store" in a.output()
    assert store(a, KEYS)
    answers = load_all(b, KEYS)  # every hit exact
    assert answers[0].num_hit == 0 and answers[0].pending  # promoted first, then a hit
    final = answers[-1]
    assert final.promoted == tuple(range(len(KEYS)))  # every block came up from the pool
    assert set(final.sources) == {BlockSource.CLUSTER}
    stats = cluster_stats(b)
    assert stats.promotions == len(KEYS) and stats.up
    assert (stats.checksum_failures, stats.errors) == (0, 0)
    # the same figures as metrics with tier="cluster", and a line in `tiercache status`
    url = metrics_url(b)
    assert sample(scrape(url), "tiercache_tier_promotions_total", tier="cluster") == len(KEYS)
    assert sample(scrape(metrics_url(a)), "tiercache_tier_demotions_total",
                  tier="cluster") == len(KEYS)
    out = subprocess.run([sys.executable, "-m", "tiercache", "status", "--config",
                          str(b.config_path)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "cluster tier: up, this node's segment holds" in out.stdout
    assert f"{len(KEYS)} promoted" in out.stdout


def test_two_clients_asking_for_one_block_promote_it_once(start_node):
    a, b = start_node("a"), start_node("b")
    assert store(a, KEYS[:1])
    with Client(b.config) as one, Client(b.config) as two:
        first, second = one.lease(KEYS[:1]), two.lease(KEYS[:1])
        assert (first.num_hit, first.pending) == (0, True)
        assert second.pending or second.num_hit == 1  # the same promotion (or done)
        lease_hits(one, KEYS[:1])
        lease_hits(two, KEYS[:1])
    assert cluster_stats(b).promotions == 1


def test_a_node_of_another_geometry_sees_none_of_it(start_node):
    a, c = start_node("a"), start_node("c", page=2 * ROW)
    assert store(a, KEYS[:8])
    exact, wrong, answers = load(c, KEYS[:8])
    assert (exact, wrong, answers[-1].num_hit) == (0, 0, 0)
    assert cluster_stats(c).promotions == 0
    ours = BlockFormat.of(RegionLayout.from_config(a.config))
    theirs = BlockFormat.of(RegionLayout.from_config(c.config))
    assert ours.name(KEYS[0], 0) != theirs.name(KEYS[0], 0)


def test_a_cold_miss_is_not_yet_then_a_miss_and_is_remembered(start_node):
    b = start_node("b")
    keys = [b"never-stored-%d" % i for i in range(8)]
    with Client(b.config) as client, Client(b.config) as other:
        answers = lease_settled(client, keys)
        assert answers[0].pending and answers[-1].num_hit == 0
        for who in (client, other):  # remembered (exists_ttl_s): a plain miss at once
            again = who.lease(keys)
            assert (again.num_hit, again.pending) == (0, False)


def test_master_killed_lookups_miss_without_errors_and_the_tier_recovers(start_node, master):
    a, b = start_node("a"), start_node("b")
    assert store(a, KEYS[:8])
    master.kill()
    wait_for(lambda: not cluster_stats(b).up, "node b marks the tier down")
    with Client(b.config) as client:  # no error, no pending: this node's own tiers only
        answer = client.lease(KEYS[:8])
        assert (answer.num_hit, answer.pending) == (0, False)
    assert sample(scrape(metrics_url(b)), "tiercache_tier_up", tier="cluster") == 0
    assert "the tier is down" in b.output()
    with Client(a.config) as client:  # a store while down is not published, and not lost
        out = client.prepare_store([b"while-down"])
        client.complete_store(list(out.keys_to_store))
    master.start()  # an empty master on the same ports: the pool starts over
    wait_for(lambda: cluster_stats(a).up and cluster_stats(b).up, "both tiers come back")
    assert "answers again; the tier is up" in b.output()
    # a master back re-mounts the nodes' segments within a few seconds; puts before
    # that fail (counted): store fresh blocks until a batch is published
    fresh = next((keys for attempt in range(30)
                  if store(a, keys := [b"back-%d-%d" % (attempt, i) for i in range(4)], 1.0)),
                 None)
    assert fresh is not None, "node a never published again"
    load_all(b, fresh)  # 4 exact hits


@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_node_a_gone_its_blocks_miss_cleanly_on_node_b(start_node, how):
    a, b = start_node("a"), start_node("b")
    assert store(a, KEYS[:8])
    if how == "stopped":
        assert a.stop() == 0  # its segment is unmounted: its objects leave the pool
    else:
        a.kill()  # its segment stays listed until the master's client TTL: gets fail
    exact, wrong, answers = load(b, KEYS[:8])
    assert (exact, wrong, answers[-1].num_hit) == (0, 0, 0)
    stats = cluster_stats(b)
    assert stats.up and stats.promotions == 0 and stats.checksum_failures == 0


def test_a_damaged_object_in_the_pool_is_a_miss_never_a_load(start_node, master):
    """Objects a test client puts under node b's names: a flipped byte in a row, a header
    naming another key, one of another geometry's format, one cut short. Each is a miss,
    the first three counted as checksum failures, the last as an error."""
    import ctypes
    import mmap

    b = start_node("b")
    fmt = BlockFormat.of(RegionLayout.from_config(b.config), load_cluster_key(master.key_file))
    other = BlockFormat(fmt.world_size, fmt.row_stride, (ROW // 2, ROW // 2),
                        fmt.block_size_factor, fmt.mac)
    flipped, renamed, foreign, short = (b"damaged-%d" % i for i in range(4))
    pool = MooncakePool(ClusterConfig(master=master.address,
                                      metadata_server=master.metadata_url,
                                      local_hostname="127.0.0.1", key_file=master.key_file,
                                      segment_bytes=16 << 20))
    pool.open()
    buf = mmap.mmap(-1, 1 << 20)
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    try:
        pool.register(base, len(buf))
        names, parts, at = [], [], 0
        for key, written_as, form in ((flipped, flipped, fmt), (renamed, b"someone-else", fmt),
                                      (foreign, foreign, other), (short, short, fmt)):
            for rank in range(fmt.world_size):
                row = block_pattern(written_as, rank, fmt.row_stride).tobytes()
                header = form.header(written_as, rank, row).ljust(512, b"\0")
                if key == flipped:
                    row = bytes([row[0] ^ 1]) + row[1:]
                obj = (header + row)[:100 if key == short else None]
                buf[at:at + len(obj)] = obj
                names.append(fmt.name(key, rank))
                parts.append([(base + at, len(obj))])
                at += len(obj)
        assert pool.put_from(names, parts) == [0] * len(names)
        for key in (flipped, renamed, foreign, short):
            exact, wrong, answers = load(b, [key])
            assert (exact, wrong, answers[-1].num_hit) == (0, 0, 0), key
        # a read that outlived PROMOTION_WAIT_S (a loaded machine) was a miss before its
        # check was counted: wait for the four reads' outcomes
        stats = wait_for(lambda: (s := cluster_stats(b)).checksum_failures >= 3
                         and s.errors >= 1 and s, "node b's four reads are counted")
        assert (stats.promotions, stats.checksum_failures) == (0, 3)
        assert stats.errors >= 1 and stats.up
        with Client(b.config) as client:  # a slot given back, never a READY block
            assert client.stats().ready_blocks == 0
    finally:
        pool.close()
        del base
        buf.close()


STUCK_WRITER = """
import os, signal, sys
os.environ["GLOG_minloglevel"] = "3"
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
assert store.setup("127.0.0.1", sys.argv[1], 16 << 20, 16 << 20, "tcp", "", sys.argv[2]) == 0
codes = store.batch_put_session_start(sys.argv[4:], [int(sys.argv[3])] * len(sys.argv[4:]))
assert codes == [0] * len(sys.argv[4:]), codes
print("started", flush=True)
os.kill(os.getpid(), signal.SIGKILL)  # a writer that dies mid-put (Mooncake #974)
"""


def test_a_key_a_dead_writer_left_stuck_mid_put_misses_and_stalls_nothing(start_node, master):
    a, b = start_node("a"), start_node("b")
    fmt = BlockFormat.of(RegionLayout.from_config(b.config))
    stuck = b"stuck-key"
    names = [fmt.name(stuck, rank) for rank in range(fmt.world_size)]
    child = subprocess.run([sys.executable, "-c", STUCK_WRITER, master.metadata_url,
                            master.address, str(fmt.object_bytes), *names],
                           capture_output=True, text=True)
    assert child.returncode == -9 and "started" in child.stdout, child.stderr[-2000:]
    exact, wrong, answers = load(b, [stuck])  # reserved in the pool, never written: a miss
    assert (exact, wrong, answers[-1].num_hit) == (0, 0, 0)
    store(a, [stuck, *KEYS[:3]], timeout_s=5)  # node a's publish of it does not stall a's tier
    load_all(b, KEYS[:3])  # and the blocks published beside it are exact hits
    assert (cluster_stats(a).up, cluster_stats(b).up) == (True, True)


def test_an_unreachable_master_at_start_is_a_one_line_error(make_config, tmp_path):
    from mooncake_master import free_port, make_key_file
    from tiercache.errors import ServiceError

    config = make_config(cluster=ClusterConfig(
        master=f"127.0.0.1:{free_port()}", metadata_server="http://127.0.0.1:1/metadata",
        local_hostname="127.0.0.1", key_file=str(make_key_file(tmp_path / "key")),
        segment_bytes=16 << 20, start_timeout_s=0.5))
    with pytest.raises(ServiceError) as failed:
        CoordinatorProcess(config, tmp_path / "node")
    assert "no mooncake_master answers there (waited 0.5 s, cluster.start_timeout_s)" \
        in str(failed.value)


def test_a_frozen_master_never_stalls_a_lookup(start_node, master):
    """A master that accepts connections and never answers (SIGSTOP: a black-holed network
    looks the same): the tier's calls wait, the lookups do not."""
    a, b = start_node("a"), start_node("b")
    assert store(a, KEYS[:4])
    stop_process(master.proc.pid)
    try:
        with Client(b.config, timeout_s=5.0) as client:
            first = client.lease(KEYS[:4])  # asks the pool in the background: "not yet"
            assert (first.num_hit, first.pending) == (0, True)
            time.sleep(2 * WAIT_S)  # past cluster.exists_wait_s
            for _ in range(20):  # while the pool does not answer: plain misses, at once
                again = client.lease(KEYS[:4])
                assert (again.num_hit, again.pending) == (0, False)
            out = client.prepare_store([b"host-only"])  # the host tier serves meanwhile
            client.complete_store(list(out.keys_to_store))
            assert client.lookup([b"host-only"]) == 1
    finally:
        os.kill(master.proc.pid, signal.SIGCONT)
    loads = []  # once it answers again the blocks come up, exact

    def all_exact() -> bool:
        loads.append(load(b, KEYS[:4])[:2])
        return loads[-1] == (4, 0)
    wait_for(all_exact, "the blocks come up once the master answers")
    assert all(wrong == 0 for _, wrong in loads)


def test_a_node_stops_without_waiting_on_calls_a_frozen_master_holds(start_node, master,
                                                                      monkeypatch):
    """With the master frozen (SIGSTOP) node b's health probe and promoter are in calls it
    never answers: Mooncake's RPC timeout is set to an hour for the nodes, so a stop that
    waited for them would not end. b stops cleanly all the same (region and socket gone),
    saying what it abandoned; node a's calls go on once the master does."""
    monkeypatch.setenv("MC_RPC_TIMEOUT_MS", str(3600 * 1000))
    a, b = start_node("a"), start_node("b")
    assert store(a, KEYS[:4])
    stop_process(master.proc.pid)
    try:
        with Client(b.config) as client:
            assert client.lease(KEYS[:4]).pending  # b's promoter asks the frozen pool
        wait_for(lambda: cluster_stats(b).calls_in_flight >= 2,
                 "node b's promoter and health probe wait on the frozen master")
        assert b.stop(timeout_s=300) == 0  # the bound: 2 x cluster.stop_timeout_s (2 s)
        out = b.output()
        line = next(x for x in out.splitlines() if "abandoned what the pool's master" in x)
        assert "health: exists (health probe) for" in line
        assert "promote-" in line and ": exists for" in line
        assert "Mooncake's close (not started: calls in it)" in line
        assert "stopped; removed region" in out
        assert not [n for n in os.listdir("/dev/shm") if b.config.name in n]
        assert not os.path.exists(b.config.socket_path)
        assert master.proc.poll() is None  # stopped while the master was still frozen
    finally:
        os.kill(master.proc.pid, signal.SIGCONT)
    # node a publishes again once the master answers: a long freeze (a loaded machine) lets
    # the master's client TTL run out for a's segment too, and puts fail (counted) until a
    # re-mounts it, so store fresh blocks until one is published
    thawed = next((key for attempt in range(30)
                   if store(a, [key := b"after-the-thaw-%d" % attempt], 2.0)), None)
    assert thawed is not None, "node a never published after the thaw"


def test_blocks_promoted_from_disk_are_published_and_those_from_the_pool_are_not(start_node):
    """Node a (host memory and a disk tier) stores blocks; the oldest are demoted to disk;
    a stops (its segment and objects leave the pool) and starts again with its disk: a
    lookup promotes them from disk, and the tier publishes them as if an engine had
    stored them: node b, which missed them before, loads them from the pool byte for byte.
    b does not publish what it promoted from the pool, and a does not publish again what
    it promoted from disk a second time while the pool still holds it."""
    a = start_node("a", num_blocks=16, disk=True)
    # 12 of 16 host slots: the disk tier demotes the oldest. KEYS[:4] are stored (and
    # published) first, so they are older than the rest: stored in one batch of 12, the 8
    # demoted were at times not KEYS[:4] (a restart rebuilt 8 blocks and KEYS[:4] missed
    # for good, nothing promoted: 3 of 8 runs two at a time; 0 of 12 three at a time since)
    assert store(a, KEYS[:4]) and store(a, KEYS[4:12])
    # until its demotions are done, not just 4 of them: they complete out of order on the
    # tier's threads, and a stop abandons those in flight (on a loaded machine the first
    # four done were once not KEYS[:4], and KEYS[:4] never came back: a miss, by design)
    wait_for(lambda: (s := cluster_stats(a, "disk")).used_blocks >= 4
             and s.queued_blocks == 0 and s.calls_in_flight == 0, "node a demotes to disk")
    assert a.stop() == 0
    b = start_node("b")
    assert load(b, KEYS[:4])[2][-1].num_hit == 0  # gone from the pool with node a

    a = start_node("a", num_blocks=16, disk=True)  # a fresh region; the disk rebuilt
    answers = load_all(a, KEYS[:4])
    assert set(answers[-1].sources) == {BlockSource.DISK}
    wait_for(lambda: cluster_stats(a).demotions >= 4, "node a publishes what its disk held")
    loads = []

    def b_loads_them() -> bool:  # once b's "the pool has not" (exists_ttl_s) runs out
        loads.append(load(b, KEYS[:4]))
        return loads[-1][:2] == (4, 0)
    wait_for(b_loads_them, "node b loads node a's disk blocks from the pool")
    assert all(wrong == 0 for _, wrong, _ in loads)
    assert set(loads[-1][2][-1].sources) == {BlockSource.CLUSTER}

    assert store(b, [b"b-own"])  # b's own block is published; what came from the pool not
    assert drained(b).demotions == 1

    fillers = [b"filler-%d" % i for i in range(16)]  # a's host evicts KEYS[:4] (on disk)
    assert store(a, fillers)
    before = drained(a)
    time.sleep(2 * TTL_S)  # a's own "the pool has them" of their publish has run out: what
    answers = load_all(a, KEYS[:4])  # a knows now is its census of what it published
    assert set(answers[-1].sources) == {BlockSource.DISK}  # up from disk again
    assert store(a, [b"a-after"])
    after = drained(a)
    assert (after.demotions + after.dropped_spills
            == before.demotions + before.dropped_spills + 1)


def test_the_blocks_a_node_published_that_the_pool_still_holds(start_node, master):
    """``used_blocks`` (tiercache_tier_blocks{tier="cluster"}): node a's blocks the pool
    held at their last check; node b promoted some of them and counts none; when the pool
    loses some (removed here by another client, as the master's eviction would), a's
    count drops by as many at their next check. a's census leases what it asks about
    only once per ``census_period_s``, so the objects are free to go (a census every
    ``retry_s`` kept them leased for good, and the remove failed with OBJECT_HAS_LEASE)."""
    a, b = start_node("a"), start_node("b")
    assert store(a, KEYS[:8])
    assert cluster_stats(a).used_blocks == 8
    load_all(b, KEYS[:2])  # 2 exact hits
    assert cluster_stats(b).used_blocks == 0
    time.sleep(CENSUS_S + 0.5)  # a's census has asked the pool about all 8 (and leased them)
    fmt = BlockFormat.of(RegionLayout.from_config(a.config))
    names = [fmt.name(key, rank) for key in KEYS[4:7] for rank in range(fmt.world_size)]
    pool = MooncakePool(ClusterConfig(master=master.address,
                                      metadata_server=master.metadata_url,
                                      local_hostname="127.0.0.1", key_file=master.key_file,
                                      segment_bytes=16 << 20))
    pool.open()
    codes = []

    def removed() -> bool:  # leased for LEASE_TTL_MS after a's census or publish asked
        codes.append(pool.remove(names))
        return all(code in (0, OBJECT_NOT_FOUND) for code in codes[-1])
    try:
        wait_for(removed, "the pool removes node a's objects", timeout_s=CENSUS_S + 2)
    finally:
        pool.close()
    assert {c for answer in codes for c in answer} <= {0, OBJECT_HAS_LEASE}
    wait_for(lambda: cluster_stats(a).used_blocks == 5, "node a's census finds three gone")
    assert sample(scrape(metrics_url(a)), "tiercache_tier_blocks", tier="cluster") == 5
    out = subprocess.run([sys.executable, "-m", "tiercache", "status", "--config",
                          str(a.config_path)], capture_output=True, text=True)
    assert "5 published by this node and in the pool at their last check" in out.stdout


def test_a_read_from_a_frozen_node_lands_in_staging_and_holds_no_host_slot(start_node,
                                                                         monkeypatch):
    """Node a frozen (SIGSTOP) after publishing: node b's reads of a's objects wait on a's
    segment; Mooncake gives up on them (TRANSFER_FAIL; after 60 s by default, here after
    2 x TRANSFER_TIMEOUT_S) without stopping them,
    and node a, thawed, answers them — into the staging area b registered for the read,
    never a host slot (only staging is registered with the pool). Meanwhile b's lookups
    miss those blocks after PROMOTION_WAIT_S instead of waiting; b holds that staging area
    out of use and frees the reads' host slots at once, so its own blocks, stored into
    every slot before node a thaws, are exact after it, nothing is held out of host memory,
    and b keeps promoting from the pool."""
    short_transfer_timeouts(monkeypatch)  # node b (started now) gives up sooner
    a, b = start_node("a"), start_node("b", num_blocks=16)
    keys = KEYS[:4]
    assert store(a, keys)
    stop_process(a.pid)
    try:
        with Client(b.config) as client:
            # settled within half the read's give-up: the lookups do not wait for the read
            answers = lease_settled(client, keys, timeout_s=TRANSFER_TIMEOUT_S)
            assert answers[0].pending and answers[-1].num_hit == 0
            wait_for(lambda: cluster_stats(b).errors >= len(keys),
                     "Mooncake gives up on node b's reads", 120)
            mine = [b"b-own-%d" % i for i in range(16)]
            out = client.prepare_store(mine)  # every host slot, the failed reads' included
            assert out is not None and list(out.keys_to_store) == mine
            with SharedOffloadRegion.attach(b.config.name) as region:
                stride = region.layout.row_stride
                for slot, key in zip(out.store_spec.block_ids.tolist(), mine):
                    for rank in range(b.config.world_size):
                        region.rank_array(rank)[slot] = block_pattern(key, rank, stride)
            client.complete_store(mine)
    finally:
        os.kill(a.pid, signal.SIGCONT)
    time.sleep(2.0)  # node a answers the reads b gave up on
    exact, wrong, _ = load(b, mine)
    assert (exact, wrong) == (len(mine), 0)
    with Client(b.config) as client:
        assert client.stats().quarantined_blocks == 0
    assert "their staging area (" in b.output()  # where the late writes land instead
    assert cluster_stats(b).promoting
    url = metrics_url(b)
    assert sample(scrape(url), "tiercache_index_blocks", state="quarantined") == 0
    assert sample(scrape(url), "tiercache_tier_promoting", tier="cluster") == 1
