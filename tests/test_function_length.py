"""The function-length rule (``function_length``): the tree keeps it, and the checker
finds a long function the allowlist does not name, and an allowlist entry whose function
is gone or now short."""

from __future__ import annotations

from function_length import LONG_FUNCTIONS, MAX_FUNCTION_LINES, function_lengths, length_findings
from house import PACKAGE, read_tree


def body(lines: int) -> str:
    """A function body of ``lines`` lines (the ``def`` line is one more)."""
    return "".join(f"    x{i} = {i}\n" for i in range(lines))


def test_no_function_is_longer_than_the_bound_unless_reviewed():
    assert not length_findings(read_tree())


def test_every_reviewed_function_carries_its_reason():
    assert all(len(reason.split()) >= 8 for reason in LONG_FUNCTIONS.values())


def test_a_length_runs_from_the_def_line_to_the_last_and_nests():
    source = ("@decorator\n"
              "def outer():\n"
              '    """Doc."""\n'
              "    def inner():\n"
              "        return 1\n"
              "    return inner\n"
              "\n"
              "class A:\n"
              "    async def method(self):\n"
              "        pass\n")
    assert function_lengths({"m": source}) == {
        "m:outer": 5, "m:outer.inner": 2, "m:A.method": 2}


def test_a_long_function_not_in_the_allowlist_is_found():
    at_bound = "def fits():\n" + body(9)
    over = "def long():\n" + body(10)
    assert length_findings({"m": at_bound}, bound=10, allowed={}) == []
    found = length_findings({"m": at_bound + over}, bound=10, allowed={})
    assert len(found) == 1 and found[0].startswith("m:long is 11 lines (over 10)")


def test_a_long_method_or_nested_function_is_found():
    source = "class A:\n    def long(self):\n" + "".join(
        f"        x{i} = {i}\n" for i in range(10))
    nested = "def outer():\n    def inner():\n" + "".join(
        f"        x{i} = {i}\n" for i in range(10))
    assert [f.split(" ")[0] for f in length_findings({"m": source}, 10, {})] == ["m:A.long"]
    assert [f.split(" ")[0] for f in length_findings({"m": nested}, 10, {})] == [
        "m:outer", "m:outer.inner"]


def test_a_long_function_in_the_allowlist_passes():
    over = "def long():\n" + body(10)
    assert length_findings({"m": over}, bound=10, allowed={"m:long": "why"}) == []


def test_a_stale_allowlist_entry_is_found():
    short = "def long():\n" + body(3)
    gone = length_findings({"m": short}, bound=10, allowed={"m:other": "why"})
    now_short = length_findings({"m": short}, bound=10, allowed={"m:long": "why"})
    assert gone == ["LONG_FUNCTIONS names m:other, which is gone: remove the entry"]
    assert now_short == ["LONG_FUNCTIONS names m:long, now 4 lines (within 10): "
                         "remove the entry"]


def test_the_bound_is_the_rule_the_docs_state():
    text = " ".join((PACKAGE.parent / "docs" / "architecture.md").read_text().split())
    assert f"no function in `tiercache/` is longer than {MAX_FUNCTION_LINES} lines" in text
