"""Wire format: round trips of every payload, and every way a frame can be wrong."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiercache import errors
from tiercache.link.describe import (
    Described, decode_describe_request, decode_described, encode_describe_request,
    encode_described,
)
from tiercache.link.namespaces import MAX_DESCRIPTION_BYTES, NAMESPACE_BYTES
from tiercache.link.payloads import (
    Hello, decode_error, decode_events, decode_hello, decode_hello_request,
    decode_lease_batch_request, decode_leases, decode_stats, decode_store_output,
    decode_store_request, encode_error, encode_events, encode_hello, encode_hello_request,
    encode_lease_batch_request, encode_leases, encode_stats, encode_store_output,
    encode_store_request, lease_batch_groups,
)
from tiercache.link.protocol import (
    ERROR_CODES, HEADER_BYTES, MAGIC, MAX_FRAME_BYTES, MAX_KEY_BYTES, MAX_KEYS_PER_CALL,
    MAX_LISTS_PER_BATCH, MAX_NAME_BYTES, MAX_REQUEST_BYTES, PROTOCOL_VERSION, VARIABLE_WIDTH,
    FrameHeader, PayloadReader, PayloadWriter, Status, Verb, frame,
)
from tiercache.results import LeaseResult, ManagerStats, OffloadingEvent, PrepareStoreOutput
from tiercache.specs import CPULoadStoreSpec

keys_strategy = st.lists(st.binary(min_size=0, max_size=MAX_KEY_BYTES), max_size=50)


def raw_header(magic=MAGIC, version=PROTOCOL_VERSION, verb=1, status=0, request_id=7, size=0):
    return struct.pack("<4sBBBBII", magic, version, verb, status, 0, request_id, size)


def test_header_layout_is_the_documented_one():
    data = frame(Verb.PREPARE_STORE, 0xDEADBEEF, b"abc", Status.ERROR)
    assert HEADER_BYTES == 16
    assert data[0:4] == b"TCKV" and data[4] == PROTOCOL_VERSION
    assert data[5] == Verb.PREPARE_STORE and data[6] == Status.ERROR and data[7] == 0
    assert data[8:12] == (0xDEADBEEF).to_bytes(4, "little")
    assert data[12:16] == (3).to_bytes(4, "little") and data[16:] == b"abc"
    header = FrameHeader.unpack(data)
    assert header == FrameHeader(Verb.PREPARE_STORE, Status.ERROR, 0xDEADBEEF, 3)


@pytest.mark.parametrize(("fields", "message"), [
    ({"magic": b"HTTP"}, "bad frame magic"),
    ({"version": 1}, "protocol version 1 is not supported"),  # before sessions
    ({"version": 2}, "protocol version 2 is not supported"),  # before fenced specs
    ({"version": 3}, "protocol version 3 is not supported"),  # before lease specs
    ({"version": 4}, "protocol version 4 is not supported"),  # before TIER_STATS
    ({"version": PROTOCOL_VERSION + 1}, f"protocol version {PROTOCOL_VERSION + 1} is not"),
    ({"size": MAX_FRAME_BYTES + 1}, f"at most {MAX_FRAME_BYTES}"),
    ({"verb": 0}, "bad frame header"),
    ({"verb": 200}, "bad frame header"),
    ({"status": 9}, "bad frame header"),
])
def test_bad_headers_are_protocol_errors(fields, message):
    with pytest.raises(errors.ProtocolError, match=message):
        FrameHeader.unpack(raw_header(**fields))


@given(keys_strategy)
def test_keys_round_trip(keys):
    reader = PayloadReader(PayloadWriter().keys(keys).build())
    assert reader.keys() == keys
    reader.done()


def test_ids_and_scalars_round_trip():
    ids = np.array([5, 0, 2**40], dtype=np.int64)
    data = PayloadWriter().u8(3).u32(70000).ids(ids).text("héllo").u64s([1, 2**63]).build()
    reader = PayloadReader(data)
    assert reader.u8() == 3 and reader.u32() == 70000
    assert reader.ids().tolist() == ids.tolist()
    assert reader.text() == "héllo" and reader.u64s(2) == (1, 2**63)
    reader.done()


def test_writer_refuses_what_the_wire_cannot_carry():
    with pytest.raises(errors.ProtocolError, match=f"at most {MAX_KEYS_PER_CALL}"):
        PayloadWriter().keys([b"k"] * (MAX_KEYS_PER_CALL + 1))
    with pytest.raises(errors.InvalidKeyError, match=f"{MAX_KEY_BYTES + 1} bytes"):
        PayloadWriter().keys([b"a", b"x" * (MAX_KEY_BYTES + 1)])
    with pytest.raises(errors.InvalidKeyError, match="70000 bytes"):
        PayloadWriter().keys([b"x" * 70000])  # beyond u16 too
    with pytest.raises(errors.InvalidKeyError, match="key 3 is int"):
        PayloadWriter().keys([b"a", 3])
    with pytest.raises(errors.InvalidKeyError, match="bytearray"):
        PayloadWriter().keys([bytearray(b"a")])


def test_keys_of_one_width_carry_no_per_key_lengths():
    same = PayloadWriter().keys([b"ab", b"cd", b"ef"]).build()
    assert same == struct.pack("<IH", 3, 2) + b"abcdef"
    mixed = PayloadWriter().keys([b"ab", b"c"]).build()
    assert mixed == struct.pack("<IHHH", 2, VARIABLE_WIDTH, 2, 1) + b"abc"
    assert PayloadReader(struct.pack("<IH", 3, 0)).keys() == [b"", b"", b""]


@pytest.mark.parametrize(("payload", "message"), [
    (b"", "truncated"),
    (struct.pack("<IH", 2, 4) + b"abcd", "truncated"),
    (struct.pack("<IHHH", 2, VARIABLE_WIDTH, 1, 1) + b"a", "truncated"),
    (struct.pack("<IH", MAX_KEYS_PER_CALL + 1, 1), f"at most {MAX_KEYS_PER_CALL}"),
    (struct.pack("<IH", 1, MAX_KEY_BYTES + 1) + b"x" * (MAX_KEY_BYTES + 1), "keys of"),
    (struct.pack("<IHHH", 2, VARIABLE_WIDTH, 1, MAX_KEY_BYTES + 1) + b"x" * 300, "a key of"),
])
def test_reader_refuses_malformed_key_lists(payload, message):
    with pytest.raises(errors.ProtocolError, match=message):
        PayloadReader(payload).keys()


def test_reader_refuses_trailing_bytes_and_bad_text():
    reader = PayloadReader(PayloadWriter().keys([b"a"]).build() + b"\0")
    reader.keys()
    with pytest.raises(errors.ProtocolError, match="1 unexpected trailing bytes"):
        reader.done()
    with pytest.raises(errors.ProtocolError, match="UTF-8"):
        PayloadReader(struct.pack("<I", 1) + b"\xff").text()


def test_store_output_round_trips_including_none():
    out = PrepareStoreOutput((b"3", b"4"), CPULoadStoreSpec([2, 0], [9, 2**64 - 1], 0xABC),
                             (b"1",), (b"5", b"6"))
    back = decode_store_output(PayloadReader(encode_store_output(out)))
    assert back.keys_to_store == out.keys_to_store and back.evicted_keys == out.evicted_keys
    assert back.no_room_keys == (b"5", b"6")
    assert back.store_spec.block_ids.tolist() == [2, 0]
    assert back.store_spec.slot_gens.tolist() == [9, 2**64 - 1]  # the fence travels whole
    assert back.store_spec.region_id == 0xABC
    assert decode_store_output(PayloadReader(encode_store_output(None))) is None


def test_an_unfenced_spec_stays_unfenced_on_the_wire():
    back = PayloadReader(PayloadWriter().spec(CPULoadStoreSpec([5])).build()).spec()
    assert back.block_ids.tolist() == [5] and not back.fenced and back.slot_gens is None


def test_store_output_with_mismatched_ids_is_refused():
    bad = (PayloadWriter().u8(1).keys([b"a", b"b"]).spec(CPULoadStoreSpec(np.array([1])))
           .keys([]).keys([]).build())
    with pytest.raises(errors.ProtocolError, match="2 keys but 1 slot ids"):
        decode_store_output(PayloadReader(bad))
    with pytest.raises(errors.ProtocolError, match="flag 7"):
        decode_store_output(PayloadReader(b"\x07"))


def test_events_and_stats_round_trip():
    events = [OffloadingEvent((b"1", b"2"), removed=False), OffloadingEvent((b"9",), removed=True)]
    assert decode_events(PayloadReader(encode_events(events))) == events
    stats = ManagerStats(*range(1, 19))
    back = decode_stats(PayloadReader(encode_stats(stats)))
    assert back == stats and back.occupancy == stats.occupancy


@pytest.mark.parametrize("cls", list(ERROR_CODES.values()))
def test_errors_come_back_as_the_same_class(cls):
    back = decode_error(PayloadReader(encode_error(cls("the message"))))
    assert type(back) is cls and str(back) == "the message"


def test_unexpected_errors_travel_as_the_base_class_with_their_type():
    back = decode_error(PayloadReader(encode_error(RuntimeError("boom"))))
    assert type(back) is errors.TiercacheError and str(back) == "RuntimeError: boom"
    unknown = PayloadWriter().u32(999).text("x").build()
    assert isinstance(decode_error(PayloadReader(unknown)), errors.ProtocolError)


def test_session_and_lease_payloads_round_trip():
    token = bytes(range(16))
    assert decode_hello_request(PayloadReader(encode_hello_request(token, "engine-0"))) == (
        token, "engine-0")
    assert decode_hello_request(PayloadReader(encode_hello_request(None, ""))) == (b"", "")
    hello = Hello(token, True, 2.5)
    assert decode_hello(PayloadReader(encode_hello(hello))) == hello
    lists = [[b"a", b"b"], [], [b"long" * 10]]
    assert decode_lease_batch_request(PayloadReader(encode_lease_batch_request(lists))) == lists
    results = [LeaseResult(2, False, CPULoadStoreSpec([4, 1], [7, 2**64 - 1], 0xABC)),
               LeaseResult(0, True, CPULoadStoreSpec([], [], 0xABC))]
    back = decode_leases(PayloadReader(encode_leases(results)))
    assert back == results
    assert back[0].spec.block_ids.tolist() == [4, 1]
    assert back[0].spec.slot_gens.tolist() == [7, 2**64 - 1]  # the fence travels whole
    assert back[0].spec.region_id == 0xABC and len(back[1].spec) == 0
    for limit in (None, 0, 7):
        assert decode_store_request(PayloadReader(encode_store_request([b"a"], limit))) == (
            [b"a"], limit)


def test_bad_session_and_lease_payloads_are_refused():
    with pytest.raises(errors.ProtocolError, match="without its slots"):
        encode_leases([LeaseResult(1, False)])
    with pytest.raises(errors.SpecError, match="2 hits with 1 slots"):
        LeaseResult(2, False, CPULoadStoreSpec([3]))
    with pytest.raises(errors.ProtocolError, match="pending flag 2"):
        decode_leases(PayloadReader(PayloadWriter().u32(1).u8(2).build()))
    with pytest.raises(errors.ProtocolError, match="max_evictions = -1"):
        encode_store_request([b"a"], -1)
    with pytest.raises(errors.ProtocolError, match="token of 3 bytes"):
        encode_hello_request(b"abc", "")
    with pytest.raises(errors.ProtocolError, match=f"at most {MAX_NAME_BYTES}"):
        encode_hello_request(None, "n" * (MAX_NAME_BYTES + 1))
    short_token = PayloadWriter().raw(b"abc").text("x").build()
    with pytest.raises(errors.ProtocolError, match="token of 3 bytes"):
        decode_hello_request(PayloadReader(short_token))
    too_many = [[b"k"] * (MAX_KEYS_PER_CALL // 2 + 1)] * 2
    with pytest.raises(errors.ProtocolError, match=f"at most {MAX_KEYS_PER_CALL} keys"):
        encode_lease_batch_request(too_many)
    forged = PayloadWriter().u32(2)
    for keys in too_many:
        forged.keys(keys)
    with pytest.raises(errors.ProtocolError, match=f"more than {MAX_KEYS_PER_CALL} keys"):
        decode_lease_batch_request(PayloadReader(forged.build()))


def test_the_largest_request_fits_the_request_bound():
    widest = [bytes([i % 256]) * MAX_KEY_BYTES for i in range(MAX_KEYS_PER_CALL)]
    assert len(PayloadWriter().keys(widest).build()) <= MAX_REQUEST_BYTES
    one_per_list = [[key] for key in widest]  # sent as requests of MAX_LISTS_PER_BATCH lists
    for group in lease_batch_groups(one_per_list):
        assert len(encode_lease_batch_request(group)) <= MAX_REQUEST_BYTES
    per_list = MAX_KEYS_PER_CALL // MAX_LISTS_PER_BATCH  # the most lists with the most keys
    [most] = lease_batch_groups([widest[i:i + per_list]
                                 for i in range(0, MAX_KEYS_PER_CALL, per_list)])
    assert len(most) == MAX_LISTS_PER_BATCH
    assert len(encode_lease_batch_request(most)) <= MAX_REQUEST_BYTES


def test_tier_stats_round_trip_with_seconds_and_flags():
    from tiercache.link.payloads import decode_tier_stats, encode_tier_stats
    from tiercache.results import TierStats

    stats = TierStats(capacity_blocks=9, used_blocks=4, read_seconds=1.5, write_seconds=0.25,
                      promotions=3, up=False, direct_io=True)
    assert decode_tier_stats(PayloadReader(encode_tier_stats({"disk": stats}))) == \
        {"disk": stats}
    assert decode_tier_stats(PayloadReader(encode_tier_stats({}))) == {}


def test_describe_request_and_answer_round_trip_and_refuse_what_they_cannot_be():
    request = PayloadReader(encode_describe_request(2, "model=x"))
    assert decode_describe_request(request) == (2, "model=x")
    with pytest.raises(errors.ProtocolError, match="at most 65536"):
        encode_describe_request(1, "x" * (MAX_DESCRIPTION_BYTES + 1))
    with pytest.raises(errors.ProtocolError, match="not UTF-8"):
        decode_describe_request(PayloadReader(PayloadWriter().u8(1).raw(b"\xff").build()))
    answer = encode_described(Described(b"d" * NAMESPACE_BYTES, True))
    assert decode_described(PayloadReader(answer)) == Described(b"d" * NAMESPACE_BYTES, True)
    with pytest.raises(errors.ProtocolError, match="flag 2"):
        decode_described(PayloadReader(PayloadWriter().raw(b"d" * NAMESPACE_BYTES).u8(2).build()))
