"""What a worker checks before it copies a byte: that a spec's slots are the ones it was
handed (see ``CPULoadStoreSpec``'s fencing).

* **Region.** A fenced spec names the region its index belongs to (``region_id``). A worker
  mapping another region (the coordinator replaced it; this worker still maps the old,
  unlinked one) must not copy: the slot ids mean other bytes there. ``Worker`` re-attaches
  when the region now under its name is the spec's, then copies; otherwise this refuses.
* **Slot generation.** Each slot id comes with the generation the index gave the slot for
  this key. The worker reads the slot's record in its own mapping of the index ledger: a
  store needs the record WRITING with that generation (still reserved for this block), a
  load needs it READY with that generation (still this block). A slot handed to another
  key since — its reservation or pin was given back because the coordinator declared the
  session dead — has a newer generation, and the copy is refused instead of landing in (or
  reading) another block.

The check runs on the caller's thread when the transfer is submitted (numpy over the
spec's slots: microseconds; a backend that issues whole transfers natively checks the
same rule in C over ``table``, ``tiercache.native.transfer_call``). The copy itself runs
later, on the device, milliseconds at most; what could change a slot in that window is a
session declared dead, and that takes ``index.session_timeout_s`` of silence. A refusal is
a failed transfer (``TransferResult(success=False)``), never an exception in the engine's
step.
"""

from __future__ import annotations

import numpy as np

from tiercache.native.transfer_call import FenceTable
from tiercache.region.ledger import LedgerState
from tiercache.specs import CPULoadStoreSpec, Direction


class SlotFence:
    """Checks specs against the region this worker maps: ``region_id`` and the index
    ledger's records (``ledger``: ``IndexLedger.table`` over the worker's mapping)."""

    def __init__(self, region_id: int, ledger: np.ndarray):
        self.region_id = region_id
        self.table = FenceTable(region_id, ledger)  # the same rule, read by native code
        self._gen = ledger["gen"]  # column views: a gather copies 8 + 4 bytes a slot, not
        self._state = ledger["state"]  # the whole record

    def refusal(self, direction: Direction, spec: CPULoadStoreSpec) -> str | None:
        """Why ``spec`` must not be copied in ``direction``, or None when it may."""
        if not spec.fenced:
            return None
        if spec.region_id != self.region_id:
            return (f"the spec is for region {spec.region_id:#018x}; this worker maps region "
                    f"{self.region_id:#018x} (the coordinator replaced the region)")
        if spec.slot_gens is None or not len(spec):
            return None
        ids = spec.block_ids
        gens, states = self._gen[ids], self._state[ids]
        want = LedgerState.WRITING if direction.stores else LedgerState.READY
        bad = (gens != spec.slot_gens) | (states != want)
        if not bad.any():
            return None
        i = int(np.flatnonzero(bad)[0])
        state = states[i]
        state_name = LedgerState(state).name if state <= LedgerState.READY else str(state)
        return (f"slot {int(ids[i])} was handed out with generation {int(spec.slot_gens[i])} "
                f"for this {direction.label} but now has generation {int(gens[i])} "
                f"and state {state_name} ({int(bad.sum())} of {len(spec)} slots so): its "
                "reservation or pin was given back (a session declared dead) and the slot may "
                "hold another block")
