"""What each replayed engine's KV events say it holds: the prefix router's view.

``EventRecorder`` stands where vLLM's KV-event publisher stands (the scheduler hands it
every step's ``KVEventBatch``: its GPU prefix cache's ``BlockStored``/``BlockRemoved`` and,
with a connector, the offloaded tier's, medium ``CPU``) and keeps, per medium, the block
hashes the engine announced and has not removed. It reads only the events, as a router in
another process would (llm-d's KV-cache indexer subscribes to the same stream).
"""

from __future__ import annotations

from typing import Any

GPU = "GPU"
CPU = "CPU"
STORAGE = "STORAGE"  # vLLM's name for a disk tier (tiercache's node stream publishes it)


class EventRecorder:
    """See the module docstring."""

    def __init__(self) -> None:
        self.held: dict[str, set[Any]] = {}
        self.num_events = 0

    def publish(self, batch: Any) -> None:
        from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

        for event in batch.events:
            self.num_events += 1
            if isinstance(event, BlockStored):
                self.held.setdefault(event.medium or GPU, set()).update(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self.held.get(event.medium or GPU, set()).difference_update(event.block_hashes)
            elif isinstance(event, AllBlocksCleared):
                self.held.clear()

    def holds(self, medium: str, block_hash: Any) -> bool:
        return block_hash in self.held.get(medium, ())

    def shutdown(self) -> None:
        pass
