"""Entry points that control-plane tests spawn (multiprocessing ``spawn`` imports this
module by name): clients that take resources and wait to be killed, and servers run
under resource limits."""

from __future__ import annotations

import logging
import os
import resource
import signal
import threading

from tiercache.link.client import Client

WAIT_S = 300.0  # a child waits this long at most for its SIGKILL


def reserve_pin_and_wait(path: str, store_keys: list[bytes], lease_keys: list[bytes],
                         load_keys: list[bytes], tokens, holding) -> None:
    """Child: reserve ``store_keys``, lease and load others, report the session token,
    then wait to be SIGKILLed (an engine that crashes mid-request)."""
    client = Client(path, name="doomed engine")
    out = client.prepare_store(store_keys)
    assert out is not None and len(out.keys_to_store) == len(store_keys)
    if lease_keys:
        assert client.lease(lease_keys).num_hit == len(lease_keys)
    if load_keys:
        client.prepare_load(load_keys)
    tokens.put(client.session_token)
    holding.set()
    threading.Event().wait(WAIT_S)


def hold_connections_and_stop(path: str, num_without_hello: int, num_with_hello: int,
                              ready) -> None:
    """Child: open connections that never send HELLO, then ones that complete it and hold
    nothing, signal, and SIGSTOP itself (the outside tester's lock-out: a frozen process
    on every slot). Accept order is connect order, so the last HELLO answered means every
    connection was accepted."""
    from control_support import raw_connection

    held = [raw_connection(path, hello=False) for _ in range(num_without_hello)]
    held += [raw_connection(path) for _ in range(num_with_hello)]
    ready.set()
    os.kill(os.getpid(), signal.SIGSTOP)
    threading.Event().wait(WAIT_S)


def hold_partial_requests_and_stop(path: str, num: int, partial_bytes: int, ready,
                                   report) -> None:
    """Child: ``num`` connections past HELLO, each sending ``partial_bytes`` of a request of
    the largest size and no more; once the server has read them all, signal and SIGSTOP
    itself. When continued, report which of them the server closed (a list of bools)."""
    import time

    from control_support import is_open, raw_connection, request_header, unread_bytes
    from tiercache.link.protocol import MAX_REQUEST_BYTES, Verb

    held = [raw_connection(path) for _ in range(num)]
    for sock in held:
        sock.sendall(request_header(Verb.LOOKUP, MAX_REQUEST_BYTES) + b"x" * partial_bytes)
    while any(unread_bytes(sock) for sock in held):
        time.sleep(0.01)
    ready.set()
    os.kill(os.getpid(), signal.SIGSTOP)
    report.put([not is_open(sock) for sock in held])
    threading.Event().wait(WAIT_S)


def send_a_request_in_two_parts(path: str, request: bytes, split: int, sent_first,
                                go, answers) -> None:
    """Child: past HELLO, send ``request[:split]``; once the server read it, set
    ``sent_first``; wait for ``go``, send the rest and put the answer's status and payload
    (or the error that came instead) in ``answers``."""
    import time

    from control_support import raw_connection, read_frame, unread_bytes

    sock = raw_connection(path)
    sock.sendall(request[:split])
    while unread_bytes(sock):
        time.sleep(0.01)
    sent_first.set()
    go.wait(WAIT_S)
    try:
        sock.sendall(request[split:])
        header, body = read_frame(sock)
        answers.put((header.status.name, bytes(body)))
    except (OSError, AssertionError) as e:  # reported to the test, which asserts on it
        answers.put(("gone", repr(e)))


def ping_and_report(path: str, answers) -> None:
    """Child: one ``Client`` ping; put the round trip (or the error) in ``answers``."""
    try:
        with Client(path) as client:
            answers.put(client.ping())
    except Exception as e:  # reported to the test, which asserts on it
        answers.put(repr(e))


def serve_with_fd_limit(path: str, spare_fds: int, ready, log_path: str, options) -> None:
    """Child: a control server whose process may open only ``spare_fds`` more files once it
    serves (its log goes to ``log_path``), until SIGTERM."""
    from tiercache.control.server import ControlServer
    from tiercache.index.manager import OffloadingManager

    logging.basicConfig(filename=log_path, level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    server = ControlServer(OffloadingManager(64), path, options)
    server.start()
    highest_fd = max(int(fd) for fd in os.listdir(f"/proc/{os.getpid()}/fd"))
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (highest_fd + 1 + spare_fds, hard))
    ready.set()
    try:
        stop.wait(WAIT_S)
    finally:
        server.close()


def block_pattern(key: bytes, rank: int, num_bytes: int):
    """The bytes a test stores for ``key`` on ``rank``: derived from both, so a block read
    back from the wrong slot, the wrong rank or half written never matches."""
    import hashlib

    import numpy as np

    seed = np.frombuffer(hashlib.blake2b(key + bytes([rank]), digest_size=64).digest(), np.uint8)
    return np.resize(seed, num_bytes)


def rows_hold(region, slot: int, key: bytes) -> bool:
    """Whether every rank's row ``slot`` holds ``key``'s pattern."""
    import numpy as np

    stride = region.layout.row_stride
    return all(np.array_equal(region.rank_array(r)[slot], block_pattern(key, r, stride))
               for r in range(region.layout.world_size))


def store_and_load_forever(config_toml: str, seed: int, key_space: int, stored, wrong) -> None:
    """Child: an engine and its workers in one process, until SIGKILLed. Leases a random run
    of keys, loads and checks the hits (counting blocks with wrong bytes in ``wrong``),
    stores the misses by writing their patterns into every rank's row, and completes them
    (counted in ``stored``). A coordinator that goes away is waited for."""
    import random
    import time
    import tomllib

    from tiercache.config import config_from_dict
    from tiercache.errors import CoordinatorGoneError, ManagerError
    from tiercache.region.shared import SharedOffloadRegion

    config = config_from_dict(tomllib.loads(config_toml))
    region = SharedOffloadRegion.attach(config.name, timeout_s=WAIT_S)
    stride = region.layout.row_stride
    client = Client(config, timeout_s=5, name=f"workload {seed}")
    rng = random.Random(seed)
    while True:
        first = rng.randrange(key_space)
        keys = [b"key-%d" % ((first + i) % key_space) for i in range(rng.randint(1, 6))]
        try:
            lease = client.lease(keys)
            hits = keys[:lease.num_hit]
            if hits:
                spec = client.prepare_load(hits)
                bad = sum(not rows_hold(region, int(s), key)
                          for s, key in zip(spec.block_ids, hits))
                if bad:
                    with wrong.get_lock():
                        wrong.value += bad
                client.complete_load(hits)
                client.release(hits)
            out = client.prepare_store(keys[lease.num_hit:])
            if out is None or not out.keys_to_store:
                continue
            for slot, key in zip(out.store_spec.block_ids, out.keys_to_store):
                for rank in range(region.layout.world_size):
                    region.rank_array(rank)[int(slot)] = block_pattern(key, rank, stride)
            client.complete_store(list(out.keys_to_store))
            with stored.get_lock():
                stored.value += len(out.keys_to_store)
        except CoordinatorGoneError:
            time.sleep(0.02)
        except ManagerError:  # e.g. a key evicted by another engine between two calls
            continue


def check_every_hit(config, key_space: int) -> tuple[int, int]:
    """(hits, hits whose bytes are wrong) over the workload's key space, each hit pinned by
    a lease while its rows are compared (run in the test process)."""
    from tiercache.region.shared import SharedOffloadRegion

    region = SharedOffloadRegion.attach(config.name)
    hits = wrong = 0
    try:
        with Client(config) as client:
            for i in range(key_space):
                key = b"key-%d" % i
                if not client.lease([key]).num_hit:
                    continue
                hits += 1
                slot = int(client.prepare_load([key]).block_ids[0])
                wrong += not rows_hold(region, slot, key)
                client.complete_load([key])
                client.release([key])
    finally:
        region.close()
    return hits, wrong


def grab_and_wait(config_toml: str, tag: int, num_keys: int, key_space: int, holding) -> None:
    """Child: an engine that reserves ``num_keys`` slots (retrying while there is no room),
    leases a run of the workload's keys, signals, and waits to be SIGKILLed."""
    import time
    import tomllib

    from tiercache.config import config_from_dict

    client = Client(config_from_dict(tomllib.loads(config_toml)), name=f"doomed {tag}")
    keys = [b"doomed-%d-%d" % (tag, i) for i in range(num_keys)]
    while client.prepare_store(keys) is None:
        time.sleep(0.01)
    client.lease([b"key-%d" % ((tag + i) % key_space) for i in range(4)])
    holding.set()
    threading.Event().wait(WAIT_S)


def client_calls(config_toml: str, conn) -> None:
    """Child: a ``Client`` of its own process, calling what the parent sends (verb, args)
    and answering ``("ok", result)`` or ``("error", "Name: message")``, until None."""
    from tiercache.config import config_from_dict
    import tomllib

    with Client(config_from_dict(tomllib.loads(config_toml))) as client:
        while (call := conn.recv()) is not None:
            verb, args = call
            try:
                conn.send(("ok", getattr(client, verb)(*args)))
            except Exception as e:  # the parent asserts on it
                conn.send(("error", f"{type(e).__name__}: {e}"))
