"""The exporter under abuse by any local user, against a real `tiercache serve`: a flood of
half-sent requests neither grows the coordinator's threads nor starves its control
socket, and scrapers that disconnect leave no traceback in its log."""

from __future__ import annotations

import re
import selectors
import socket
import struct
import subprocess
import sys
import time
import urllib.request

import psutil

from tiercache.link.client import Client
from tiercache.metrics.exporter import DEFAULT_LIMITS
from tiercache.service.process import CoordinatorProcess

FLOOD_CONNECTIONS = 1500  # each a request line and one header, never the blank line
PINGS_AFTER = 200  # pings while the whole flood stays open
PING_BOUND_S = 1.0  # generous: each ping must be answered, and not seconds later
HALF_REQUEST = b"GET /metrics HTTP/1.1\r\nHost: tiercache\r\n"  # no blank line: half-sent


def _port(coordinator: CoordinatorProcess) -> int:
    match = re.search(r"metrics: http://127\.0\.0\.1:(\d+)/metrics", coordinator.output())
    assert match, coordinator.output()
    return int(match.group(1))


# The flood runs in its own process, so the pings really overlap it: it opens
# FLOOD_CONNECTIONS connections as fast as it can, each sending half a request, keeps
# them open, prints "flooded" and waits for its stdin to close.
_FLOODER = r"""
import socket, sys
port, count = int(sys.argv[1]), int(sys.argv[2])
held = []
for _ in range(count):
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    try:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: tiercache\r\n")
    except OSError:  # the exporter already dropped it to stay within its bound: fine
        pass
    held.append(sock)
print("flooded", flush=True)
sys.stdin.read()
"""


def test_half_open_flood_keeps_threads_bounded_and_the_control_socket_answering(make_config,
                                                                             tmp_path):
    cfg = make_config()
    with CoordinatorProcess(cfg, tmp_path) as coordinator, Client(cfg, timeout_s=10) as client:
        port = _port(coordinator)
        process = psutil.Process(coordinator.pid)
        client.ping()
        threads_before, fds_before = process.num_threads(), process.num_fds()
        most_threads, most_fds, latencies = threads_before, fds_before, []

        def ping_and_sample() -> None:
            nonlocal most_threads, most_fds
            latencies.append(client.ping())
            most_threads = max(most_threads, process.num_threads())
            most_fds = max(most_fds, process.num_fds())

        flooder = subprocess.Popen([sys.executable, "-c", _FLOODER, str(port),
                                    str(FLOOD_CONNECTIONS)],
                                   stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            with selectors.DefaultSelector() as flooded:
                flooded.register(flooder.stdout, selectors.EVENT_READ)
                while not flooded.select(0):  # pings while the flood builds up ...
                    ping_and_sample()
            assert flooder.stdout.readline() == "flooded\n"
            pings_during = len(latencies)
            for _ in range(PINGS_AFTER):  # ... and while it stays open
                ping_and_sample()
        finally:
            flooder.stdin.close()
            flooder.wait(30)
        latencies.sort()
        p50, p99 = latencies[len(latencies) // 2], latencies[int(len(latencies) * 0.99)]
        print(f"\ncontrol ping under a {FLOOD_CONNECTIONS}-connection exporter flood: "
              f"{len(latencies)} pings ({pings_during} while it built up), p50 "
              f"{p50 * 1e3:.2f} ms, p99 {p99 * 1e3:.2f} ms, max {latencies[-1] * 1e3:.2f} ms; "
              f"coordinator threads {threads_before} -> at most {most_threads}, fds "
              f"{fds_before} -> at most {most_fds}")
        assert pings_during > 0
        assert latencies[-1] < PING_BOUND_S
        assert most_threads <= threads_before + 1  # a fixed pool: no thread per connection
        # connections are capped too (+1: a new one is accepted before the oldest is closed)
        assert most_fds <= fds_before + DEFAULT_LIMITS.max_connections + 1
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
            assert b"tiercache_region_bytes" in resp.read()  # and it serves again
        assert process.num_threads() <= threads_before + 1
        assert "Traceback" not in coordinator.output()


def _reset_after(port: int, request: bytes) -> None:
    """Send ``request`` and close with a TCP reset (SO_LINGER 0), not a clean FIN."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10)
    sock.sendall(request)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_scrapers_that_disconnect_leave_no_traceback(make_config, tmp_path):
    cfg = make_config(world_size=8)
    with CoordinatorProcess(cfg, tmp_path) as coordinator:
        port = _port(coordinator)
        process = psutil.Process(coordinator.pid)
        fds_before = process.num_fds()
        for _ in range(10):
            _reset_after(port, HALF_REQUEST)  # gone in the middle of its request
            _reset_after(port, HALF_REQUEST + b"\r\n")  # gone before reading the answer
        deadline = time.monotonic() + 30
        while process.num_fds() > fds_before:  # until the exporter has closed them all
            assert time.monotonic() < deadline, "the exporter kept reset connections open"
            time.sleep(0.01)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
            assert resp.status == 200
        log = coordinator.output()
        assert "Traceback" not in log and "Error" not in log, log


def test_the_pool_size_is_what_the_readme_says():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    limits = DEFAULT_LIMITS
    assert f"{limits.scrape_workers} scrape worker threads" in readme
    assert f"at most {limits.max_connections} open connections" in readme
    assert f"{limits.request_timeout_s:.0f} s" in readme and f"{limits.max_request_bytes}" in readme
