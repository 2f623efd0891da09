"""`tiercache replay`'s trace: the JSONL format, its one-line errors, the generators."""

from __future__ import annotations

import json

import pytest

from tiercache.errors import TraceError
from tiercache.tools.replay.trace import Trace, TraceRequest, response_token_ids
from tiercache.tools.replay.workloads import Workload, WorkloadParams, generate


def test_a_trace_round_trips_through_its_file_sorted_by_arrival(tmp_path):
    trace = Trace((TraceRequest(2.0, "b", (5, 6, 7), 3), TraceRequest(0.5, "a", (1, 2), 1)))
    path = tmp_path / "t.jsonl"
    trace.write(path)
    lines = path.read_text().splitlines()
    assert json.loads(lines[0]) == {"t": 0.5, "session": "a", "prompt_token_ids": [1, 2],
                                    "output_len": 1}
    again = Trace.read(path)
    assert again.requests == trace.requests
    assert again.prompt_tokens == 5


@pytest.mark.parametrize("line, message", [
    ('{"t": 1', "t.jsonl:2: not JSON"),
    ('[1, 2]', "t.jsonl:2: a request is a JSON object"),
    ('{"session": "s", "prompt_token_ids": [1], "output_len": 1}', "t.jsonl:2: no 't' field"),
    ('{"t": -1, "session": "s", "prompt_token_ids": [1], "output_len": 1}', "t = -1.0"),
    ('{"t": 0, "session": "s", "prompt_token_ids": [1, "x"], "output_len": 1}',
     "prompt_token_ids[1] = 'x'"),
    ('{"t": 0, "session": "s", "prompt_token_ids": [], "output_len": 1}', "prompt_token_ids = []"),
    ('{"t": 0, "session": "s", "prompt_token_ids": [1], "output_len": 0}', "output_len = 0"),
    ('{"t": 0, "session": 3, "prompt_token_ids": [1], "output_len": 1}', "session = 3"),
])
def test_a_bad_line_is_one_error_naming_file_line_and_field(tmp_path, line, message):
    path = tmp_path / "t.jsonl"
    path.write_text('{"t": 0, "session": "ok", "prompt_token_ids": [1], "output_len": 1}\n'
                    + line + "\n")
    with pytest.raises(TraceError) as info:
        Trace.read(path)
    assert message in str(info.value)
    assert "\n" not in str(info.value)


def test_a_missing_or_empty_file_is_one_line(tmp_path):
    with pytest.raises(TraceError, match="No such file"):
        Trace.read(tmp_path / "absent.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(TraceError, match="no requests"):
        Trace.read(tmp_path / "empty.jsonl")


@pytest.mark.parametrize("workload", list(Workload))
def test_generators_are_deterministic_by_seed(workload):
    params = WorkloadParams(num_requests=30, seed=3)
    one, two = generate(workload, params), generate(workload, params)
    assert one.requests == two.requests and len(one.requests) == 30
    assert generate(workload, WorkloadParams(num_requests=30, seed=4)).requests != one.requests
    assert all(r.prompt_len <= params.max_prompt_tokens for r in one.requests)
    assert one.summary()["sources"]


def test_a_chat_turn_resends_the_conversation_with_the_engines_answer():
    trace = generate(Workload.CHAT, WorkloadParams(num_requests=200, seed=1))
    by_session: dict[str, list[TraceRequest]] = {}
    for r in trace.requests:
        by_session.setdefault(r.session, []).append(r)
    multi = [turns for turns in by_session.values() if len(turns) > 1]
    assert multi, "LMSYS's 2.0 turns per conversation give multi-turn sessions"
    for turns in multi:
        for first, second in zip(turns, turns[1:]):
            sent = first.prompt_token_ids + tuple(response_token_ids(first.prompt_token_ids,
                                                                     first.output_len))
            assert second.prompt_token_ids[:len(sent)] == sent
            assert second.t > first.t


def test_system_prompts_and_rag_documents_are_shared_prefixes():
    sp = generate(Workload.SYSTEM_PROMPT, WorkloadParams(num_requests=50, num_system_prompts=2))
    assert len({r.prompt_token_ids[:1024] for r in sp.requests}) == 2
    rag = generate(Workload.RAG, WorkloadParams(num_requests=100, num_docs=20, doc_tokens=64))
    firsts = [r.prompt_token_ids[:64] for r in rag.requests]
    assert len(set(firsts)) < len(firsts)  # popular documents lead more than one prompt
    none = generate(Workload.NONE, WorkloadParams(num_requests=50))
    assert len({r.prompt_token_ids[:16] for r in none.requests}) == 50
