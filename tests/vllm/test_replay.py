"""`tiercache replay` end to end: real vLLM schedulers per system, hits known by hand, the
accounting identity, a router that reads the engines' KV events, the command line.

No timed assertions: the TTFTs are the cost model's, and only their order is checked where
the hits alone decide it."""

from __future__ import annotations

import json
import random
from pathlib import Path

from vllm_env import require_vllm

require_vllm()

import pytest  # noqa: E402

from tiercache.cli import main  # noqa: E402
from tiercache.tools.replay.cli import replay  # noqa: E402
from tiercache.tools.replay.routers import RouterKind  # noqa: E402
from tiercache.tools.replay.systems import System  # noqa: E402
from tiercache.tools.replay.trace import Trace, TraceRequest  # noqa: E402
from tiercache.tools.replay.workloads import Workload, WorkloadParams, generate  # noqa: E402

LLAMA = Path(__file__).parents[1] / "fixtures" / "models" / "Llama-3.1-8B-Instruct"
GPU_TOKENS = 8192  # the least the replay allows: 512 blocks of 16 tokens
BLOCK_BYTES = 2 * 1024 * 1024  # Llama-3.1-8B: 32 layers x 64 KiB per 16-token block
ALL = [System.NONE, System.VLLM_NATIVE, System.TIERCACHE]


def prompt(seed: int, n: int) -> tuple[int, ...]:
    rng = random.Random(seed)
    return tuple(rng.randrange(1000, 30000) for _ in range(n))


def hits(report: dict, system: System) -> dict[str, int]:
    return report["systems"][system.value]["hit_tokens"]


def run(requests: list[TraceRequest], router=RouterKind.ROUND_ROBIN, engines: int = 1,
        dram_bytes: int = 2048 * BLOCK_BYTES, systems=ALL) -> dict:
    return replay(Trace(tuple(requests)), LLAMA, systems, router, engines=engines,
                  dram_bytes=dram_bytes, gpu_kv_tokens=GPU_TOKENS)


def test_one_engine_hits_by_hand_gpu_then_host_after_the_gpu_forgot():
    """P (100 tokens: 6 full blocks) twice, fillers between that push P out of the GPU
    (12 x 1600 tokens > 8192): the second P finds its 6 blocks in host memory with either
    offloading system and nowhere without; the third P, right after, on the GPU."""
    p = prompt(0, 100)
    requests = [TraceRequest(0.0, "p", p, 2)]
    requests += [TraceRequest(1.0 + i, f"f{i}", prompt(100 + i, 1600), 2) for i in range(12)]
    requests += [TraceRequest(20.0, "p", p, 2), TraceRequest(30.0, "p", p, 2)]
    report = run(requests)
    assert hits(report, System.NONE) == {"gpu": 96, "host": 0, "disk": 0}
    assert hits(report, System.VLLM_NATIVE) == {"gpu": 96, "host": 96, "disk": 0}
    assert hits(report, System.TIERCACHE) == {"gpu": 96, "host": 96, "disk": 0}
    for s in report["systems"].values():
        assert s["requests"] == 15 and s["prompt_tokens"] == 3 * 100 + 12 * 1600
        assert s["computed_prefill_tokens"] == s["prompt_tokens"] - sum(s["hit_tokens"].values())
    assert report["systems"]["tiercache"]["loaded_blocks_checked"] == 6  # P's, on its host hit
    assert report["systems"]["tiercache"]["bytes_scale"] == BLOCK_BYTES / 2048


def test_two_engines_a_prefix_stored_by_one_is_a_host_hit_on_the_other_only_when_shared():
    """Round robin sends P to engine 0, then to engine 1: vLLM's per-engine CPU caches
    cannot serve engine 1; tiercache's node cache can."""
    p = prompt(1, 200)  # 12 full blocks, 192 tokens
    requests = [TraceRequest(0.0, "p", p, 2), TraceRequest(1.0, "q", prompt(2, 50), 2),
                TraceRequest(2.0, "r", prompt(3, 50), 2), TraceRequest(3.0, "p", p, 2)]
    report = run(requests, engines=2)
    assert hits(report, System.NONE) == {"gpu": 0, "host": 0, "disk": 0}
    assert hits(report, System.VLLM_NATIVE) == {"gpu": 0, "host": 0, "disk": 0}
    assert hits(report, System.TIERCACHE) == {"gpu": 0, "host": 192, "disk": 0}
    assert report["systems"]["tiercache"]["loaded_blocks_checked"] == 12
    ttft = {name: s["ttft_s"]["p99"] for name, s in report["systems"].items()}
    assert ttft["none"] == ttft["vllm_native"]  # same schedule, no hit


def test_the_prefix_router_reads_the_engines_events():
    """P and Q arrive together (engine 0 and 1); Q again, later: the prefix router sends it
    where the events say Q's blocks are (engine 1: a GPU hit), least-loaded to engine 0."""
    q = prompt(5, 120)  # 7 full blocks
    requests = [TraceRequest(0.0, "p", prompt(4, 120), 2), TraceRequest(0.0, "q", q, 2),
                TraceRequest(5.0, "q", q, 2)]
    by_prefix = run(requests, RouterKind.PREFIX, engines=2, systems=[System.NONE])
    by_load = run(requests, RouterKind.LEAST_LOADED, engines=2, systems=[System.NONE])
    assert hits(by_prefix, System.NONE)["gpu"] == 112
    assert hits(by_load, System.NONE)["gpu"] == 0


@pytest.mark.parametrize("workload", [Workload.CHAT, Workload.RAG])
def test_the_accounting_identity_holds_for_every_system(workload):
    trace = generate(workload, WorkloadParams(num_requests=24, rate_rps=8.0, seed=2,
                                              num_docs=8, doc_tokens=256))
    report = replay(trace, LLAMA, ALL, RouterKind.ROUND_ROBIN, engines=2,
                    dram_bytes=256 * BLOCK_BYTES, gpu_kv_tokens=GPU_TOKENS)
    for s in report["systems"].values():
        h = s["hit_tokens"]
        assert s["computed_prefill_tokens"] + h["gpu"] + h["host"] + h["disk"] == \
            s["prompt_tokens"] == trace.prompt_tokens
        assert s["requests"] == 24 and s["throughput_rps"] > 0
        assert set(s["ttft_s"]) == {"p50", "p90", "p99"}


def test_the_command_writes_the_issues_json_shape(tmp_path, capsys):
    path = tmp_path / "out.json"
    assert main(["replay", "--generate", "none", "--requests", "6", "--model", str(LLAMA),
                 "--engines", "1", "--dram", "1GiB", "--gpu-kv-tokens", str(GPU_TOKENS),
                 "--systems", "none,vllm_native", "--json", str(path), "--quiet"]) == 0
    out = capsys.readouterr().out
    assert "not a served model" in out and "vllm_native" in out
    report = json.loads(path.read_text())
    assert set(report) >= {"systems", "engines", "dram_bytes", "trace", "cost_model"}
    assert report["engines"] == 1 and report["dram_bytes"] == 1 << 30
    s = report["systems"]["vllm_native"]
    assert set(s) >= {"requests", "prompt_tokens", "computed_prefill_tokens", "hit_tokens",
                      "ttft_s", "throughput_rps"}
    cost = report["cost_model"]["none"]
    assert cost["provenance"]["measured_on_gpu"] is True
    assert cost["calibration"] == "docs/results/model_cost_h100_llama8b.json"


def test_bad_arguments_are_one_line(tmp_path, capsys):
    assert main(["replay", "--generate", "none", "--model", str(LLAMA), "--dram", "1GiB",
                 "--systems", "none,bogus"]) == 1
    assert "--systems 'none,bogus': allowed" in capsys.readouterr().err
    (tmp_path / "t.jsonl").write_text("{}\n")
    assert main(["replay", "--trace", str(tmp_path / "t.jsonl"), "--model", str(LLAMA),
                 "--dram", "1GiB"]) == 1
    assert "t.jsonl:1: no 't' field" in capsys.readouterr().err
