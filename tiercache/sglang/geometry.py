"""What an SGLang rank's host pool needs of a region, checked at attach, and the config that
fits it (``tiercache config-for-sglang``).

SGLang's host pool describes a page through ``get_page_buffer_meta``: ``page_first``,
``page_first_direct`` and ``page_head`` give a K and a V blob per page (``layers x page
x heads x head_dim`` elements each), ``layer_first`` one blob per layer and K/V, an MLA
pool one latent blob. A region row is a byte container (``tiercache.transfer.host_pages``):
a page fits when the row's payload is exactly the page's bytes, whatever the row's
tensor split, so a region sized for vLLM (one tensor per layer, K and V together) serves
an SGLang engine of the same model and per-rank bytes as well.

Which rank's slice a process uses: an MHA rank's shard goes to its own rank's slice when
the region has one rank per TP rank (a region shared with vLLM, TP = world_size), and to
rank 0's when the region has one rank (``config-for-sglang``'s: every TP rank process
attaches rank 0, its keys carry its TP rank, so no row of any slice sits empty); MLA
pages (one replicated object, one writer) always go to rank 0's. Anything else is
refused with one error naming both sides and the config lines that fit.

No sglang import here: the backend checks against it; what SGLang's pool holds for a
model is asked of SGLang (``tiercache.sglang.model_pool``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tiercache.config import (
    MAX_ATTACHMENTS_PER_RANK, Config, KVGeometry, RegionConfig, config_to_toml,
)
from tiercache.errors import ConfigError, LayoutMismatchError
from tiercache.region.layout import RegionLayout
from tiercache.sizes import format_bytes

LAYOUTS = ("page_first", "page_first_direct", "page_head", "layer_first")  # v1 zero-copy
DEFAULT_ENGINES = 4  # SGLang engines of one TP size a config-for-sglang region admits at once


@dataclass(frozen=True)
class PoolGeometry:
    """One SGLang rank's host pool as tiercache sees it."""

    layout: str
    kv_dtype: str
    page_size: int  # tokens per page
    blob_bytes: tuple[int, ...]  # one page's blobs (get_page_buffer_meta), stream order
    tp_size: int
    tp_rank: int
    is_mla: bool

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ConfigError(f"--hicache-mem-layout {self.layout}: tiercache takes "
                              f"{', '.join(LAYOUTS)} (SGLang's zero-copy page layouts)")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ConfigError(f"tp_rank {self.tp_rank} outside 0..{self.tp_size - 1}")

    @property
    def page_bytes(self) -> int:
        return sum(self.blob_bytes)

    def data_rank(self, layout: RegionLayout) -> int:
        """The region rank whose slice holds this process's pages (module docstring)."""
        if self.is_mla or layout.world_size == 1:
            return 0
        return self.tp_rank

    def mismatches(self, layout: RegionLayout) -> list[str]:
        found = []
        if not self.is_mla and layout.world_size not in (1, self.tp_size):
            found.append(f"ranks: engine TP {self.tp_size}, region {layout.world_size} "
                         "(an SGLang engine needs 1 rank, or one per TP rank)")
        if self.page_bytes != layout.row_payload_bytes:
            found.append(f"KV bytes per page per rank: engine {self.page_bytes} "
                         f"({_blobs(self.blob_bytes)}, {self.page_size} tokens, {self.layout}), "
                         f"region {layout.row_payload_bytes} per block "
                         f"({_blobs(layout.cpu_page_bytes)})")
        return found

    def check(self, layout: RegionLayout, where: str) -> None:
        """``LayoutMismatchError`` naming every difference and the config lines that fit."""
        found = self.mismatches(layout)
        if found:
            raise LayoutMismatchError(
                f"this SGLang engine (TP rank {self.tp_rank}) does not fit the tiercache region "
                f"{where}: " + "; ".join(found) + ". A coordinator config for this engine "
                f"needs: {self.config_lines()} (`tiercache config-for-sglang` prints one)")

    def region_page_bytes(self) -> tuple[int, ...]:
        """``kv.page_bytes`` of a region made for this engine: K and V (MHA), the latent
        page (MLA)."""
        if self.is_mla or self.page_bytes % 2:
            return (self.page_bytes,)
        return (self.page_bytes // 2,) * 2

    def config_lines(self) -> str:
        pages = ", ".join(map(str, self.region_page_bytes()))
        return (f"[instance] world_size = 1; [kv] page_bytes = [{pages}], block_tokens = "
                f"{self.page_size}, block_size_factor = 1")

    def config(self, name: str, capacity_bytes: int, engines: int = DEFAULT_ENGINES) -> Config:
        """A coordinator config for this engine: one rank, every TP rank process an
        attachment of it (``engines`` such engines at once, at most 16 attachments)."""
        attachments = min(MAX_ATTACHMENTS_PER_RANK, engines * self.tp_size)
        return Config(name=name, world_size=1,
                      kv=KVGeometry(page_bytes=self.region_page_bytes(), block_size_factor=1,
                                    block_tokens=self.page_size),
                      region=RegionConfig(capacity_bytes=capacity_bytes,
                                          attachments_per_rank=max(attachments, 1)))


def coordinator_toml(pool: PoolGeometry, config: Config, model: str) -> str:
    """The TOML `tiercache serve --config` runs for this engine, with a header comment."""
    layout = RegionLayout.from_config(config)
    kind = "MLA" if pool.is_mla else f"TP {pool.tp_size}"
    head = (f"# tiercache coordinator for SGLang engines of {model} ({kind}, {pool.kv_dtype} KV, "
            f"page {pool.page_size} tokens, {pool.layout}): {format_bytes(pool.page_bytes)} per "
            f"page per rank; every rank process attaches rank 0 (its keys carry its TP rank); "
            f"{layout.num_blocks} pages ({format_bytes(layout.total_bytes)} of /dev/shm)\n")
    return head + config_to_toml(config)


def _blobs(sizes: tuple[int, ...]) -> str:
    distinct = sorted(set(sizes))
    if len(distinct) == 1:
        return f"{len(sizes)} x {distinct[0]} B"
    return "[" + ", ".join(map(str, sizes)) + "]"
