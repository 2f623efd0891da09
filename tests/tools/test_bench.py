"""``tiercache bench`` on a CPU host: the cpu backend end to end, the help, the backend
names it takes, and how the table names what actually ran."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tiercache.backend_kind import BackendKind
from tiercache.errors import ConfigError
from tiercache.tools.bench.cli import build_parser
from tiercache.tools.bench.report import Report, format_report
from tiercache.tools.bench.rig import BenchBackend


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tiercache", "bench", *args],
                          capture_output=True, text=True)


def test_cpu_bench_prints_the_table_and_writes_every_figure(tmp_path):
    out = tmp_path / "bench.json"
    run = bench("--backend", "cpu", "--cpu-transfer-mib", "2", "--reps", "2",
                "--page-kib", "16", "2048", "--json", str(out))
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert lines[0] == "machine: host only (cpu backend)"
    assert lines[1].startswith("ceiling: gpu_to_cpu ")
    rows = [line.split() for line in lines[4:]]
    assert [(r[0], r[1], r[2], r[3], r[6]) for r in rows] == [
        ("16", "KiB", "x", "1t", "cpu"), ("2", "MiB", "x", "1t", "cpu")]
    assert "[3/3] 2 MiB x 1t x 1b cpu copy" in run.stderr
    doc = json.loads(out.read_text())
    assert [(r["page_bytes"], r["backend"]) for r in doc["rows"]] == [(16384, "cpu"),
                                                                      (2 << 20, "cpu")]
    assert all(r["gpu_to_cpu"] > 0 for r in doc["rows"])


def test_cpu_runs_alone_and_unknown_names_are_refused_naming_the_choices():
    run = bench("--backend", "cpu", "ce")
    assert run.returncode == 2 and "--backend cpu runs alone" in run.stderr
    run = bench("--backend", "warp")
    assert run.returncode == 2
    assert ("--backend = 'warp': allowed 'auto', 'ce', 'kernel', 'staged', 'cpu', 'ce_loop', "
            "or a variant: ce-stream, staged-python, staged-CHUNKMIB-SLOTS") in run.stderr


def test_help_explains_every_option_in_plain_text():
    parser = build_parser()
    for action in parser._actions:
        assert action.help, f"{action.option_strings} has no help"
        assert "``" not in action.help
    text = parser.format_help()
    assert "``" not in text and "--matmul-backends" in text
    description = parser.description
    assert description.endswith(".") and "``" not in description


@pytest.mark.parametrize("text, kind, variant", [
    ("auto", BackendKind.AUTO, False), ("ce", BackendKind.CE, False),
    ("ce_loop", BackendKind.CE_LOOP, False), ("ce-stream", BackendKind.CE, True),
    ("staged-32-2", BackendKind.STAGED, True), ("staged", BackendKind.STAGED, False),
])
def test_backend_names_are_kinds_or_named_variants(text, kind, variant):
    backend = BenchBackend.parse(text)
    assert (backend.label, backend.kind, backend.factory is not None) == (text, kind, variant)


@pytest.mark.parametrize("text", ["staged-32", "ce-loop", "none", "CE"])
def test_names_that_are_neither_are_refused(text):
    with pytest.raises(ConfigError, match=f"= '{text}': allowed"):
        BenchBackend.parse(text)


def test_table_names_what_ran_where_it_is_not_the_kind_asked_for():
    report = Report("m", {"gpu_to_cpu": 50.0, "cpu_to_gpu": 50.0, "both": 100.0})
    rates = dict(gpu_to_cpu=45.0, cpu_to_gpu=46.0, both=90.0)
    report.add(workload="w", backend="auto", kind="auto", store_name="staged",
               load_name="staged", **rates)
    report.add(workload="w", backend="ce", kind="ce", store_name="ce_loop",
               load_name="ce_loop", **rates)
    report.add(workload="w", backend="ce-stream", kind="ce", store_name="ce", load_name="ce",
               **rates)
    names = [line.split()[1] for line in format_report(report).splitlines()[4:]]
    assert names == ["auto=staged/staged", "ce=ce_loop/ce_loop", "ce-stream"]


def test_run_step_submits_back_to_back_and_returns_when_every_transfer_reported():
    """The engine pattern's step through real handlers (cpu backend, host streams): a
    store and a load submitted back to back, both moved when it returns, one host time
    per call, and ``watch`` counted per call it changed across."""
    import itertools

    import torch

    from tiercache.backends.cpu import CpuCopyBackend
    from tiercache.device.host_streams import HostStreams
    from tiercache.pages import PageArray
    from tiercache.planning.planner import TransferPlanner
    from tiercache.specs import CPULoadStoreSpec, Direction, GPULoadStoreSpec
    from tiercache.tools.bench.engine import run_step
    from tiercache.transfer.wiring import build_handlers

    page, blocks = 4096, 8
    gpu = torch.arange(blocks * page, dtype=torch.int32).to(torch.uint8)
    host = torch.zeros(blocks * page, dtype=torch.uint8)
    planner = TransferPlanner([PageArray(gpu.data_ptr(), blocks, page, page)],
                              [PageArray(host.data_ptr(), blocks, page, page)], 1)
    handlers = build_handlers(planner, {d: CpuCopyBackend() for d in Direction}, HostStreams())
    try:
        ticks = itertools.count()
        specs = [(GPULoadStoreSpec([1, 2]), CPULoadStoreSpec([5, 6])),
                 (CPULoadStoreSpec([3]), GPULoadStoreSpec([7]))]
        wall, took, changed = run_step(handlers, iter(range(1, 100)), specs,
                                       watch=lambda: next(ticks))
        assert len(took) == 2 and 0 < sum(took) <= wall and changed == 2
        assert handlers.gpu_to_cpu_handler.num_in_flight == 0
        assert handlers.cpu_to_gpu_handler.num_in_flight == 0
        assert torch.equal(host[5 * page:7 * page], gpu[page:3 * page])
        assert torch.equal(gpu[7 * page:8 * page], host[3 * page:4 * page])
        _, _, unchanged = run_step(handlers, iter(range(100, 200)), specs[:1], spin=True,
                                   watch=lambda: 0)
        assert unchanged == 0
    finally:
        handlers.shutdown()
