"""``tiercache bench``: how fast each copy backend moves KV pages on this machine, against
the same run's ceiling (one large pinned copy).

Default workload: a Llama-3-8B-like rank — 64 tensors (32 layers x K, V) of 32 KiB
pages, 256 blocks per transfer (16384 pages, 512 MiB) — and the page-size sweep keeps
512 MiB per transfer (16 KiB: 512 blocks; 64 KiB: 128; 2 MiB: one cross-layer tensor,
256 blocks). Host memory is pinned and laid out in region rows (``RegionLayout``);
GPU and host block ids are random, so nothing merges by luck. Plans come from the real
``TransferPlanner`` (its descriptor order is what ``staged`` sees in production), and
backends from the real registry (``tiercache.backends``), as a worker builds them.

Figures (every rate also as a ratio to the same-run ceiling):
  * per page size x backend: store (gpu_to_cpu), load (cpu_to_gpu), both at once;
  * ``--matmul``: a bf16 matmul's speed beside continuous both-ways copies;
  * one block (64 pages) latency, GPU-timed, against 1.5 x wire time + 20 µs;
  * host-side submit time of one 16384-page transfer (``submit``), and the
    planner's time for it.
``--backend cpu`` measures the cpu backend against one large memmove (any machine).

Modules: ``workloads`` (what a transfer looks like), ``rig`` (GPU buffers, plans,
backends and timing), ``figures`` (the GPU measurements), ``host`` (the cpu backend's
bench), ``report`` (progress lines and the table), ``cli`` (arguments).
"""

from tiercache.tools.bench.cli import main

__all__ = ["main"]
