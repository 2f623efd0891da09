"""What a rank reports for its slice: one phrase per state, and the worst of several
attachments (an engine on the other socket sharing the rank must show)."""

from __future__ import annotations

from tiercache.numa.placement import NumaPlacement, NumaState

PLACED = NumaPlacement(NumaState.PLACED, 1, 1000, 1000, 0.2)
HALF = NumaPlacement(NumaState.PLACED, 0, 1000, 500, 0.2)
OFF = NumaPlacement(NumaState.OFF, 1, 1000, 250, 0.1)
UNKNOWN = NumaPlacement(NumaState.UNKNOWN_NODE)
FAILED = NumaPlacement(NumaState.FAILED, 3)


def test_each_state_reads_as_one_phrase():
    assert NumaPlacement().describe() == "NUMA not checked"
    assert PLACED.describe() == "NUMA placed on node 1 (100.0% of the slice's pages there)"
    assert HALF.describe() == "NUMA placed on node 0 (50.0% of the slice's pages there)"
    assert OFF.describe() == "NUMA placement off (node 1, 25.0% of the slice's pages there)"
    assert NumaPlacement(NumaState.OFF).describe() == "NUMA placement off (node unknown)"
    assert UNKNOWN.describe() == "NUMA node UNKNOWN (nothing bound; the worker's log says why)"
    assert FAILED.describe().startswith("NUMA placement FAILED on node 3")


def test_the_ratio_exists_only_where_pages_were_counted_on_a_known_node():
    assert (PLACED.local_ratio, HALF.local_ratio, OFF.local_ratio) == (1.0, 0.5, 0.25)
    assert UNKNOWN.local_ratio is None and FAILED.local_ratio is None
    assert NumaPlacement(NumaState.PLACED, 0, 0, 0).local_ratio is None


def test_a_rank_reports_the_worst_of_its_attachments():
    assert NumaPlacement.worst([]) == NumaPlacement()
    assert NumaPlacement.worst([PLACED, HALF]) == HALF  # the less local of two placed
    assert NumaPlacement.worst([PLACED, OFF, HALF]) == OFF
    assert NumaPlacement.worst([OFF, UNKNOWN, PLACED]) == UNKNOWN
    assert NumaPlacement.worst([UNKNOWN, FAILED, PLACED]) == FAILED
    assert [s.label for s in NumaState] == ["none", "placed", "off", "unknown_node", "failed"]
