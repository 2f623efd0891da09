"""The per-rank KV geometry an engine announces, checked against a coordinator's region.

A region is sized and laid out for one geometry: ``world_size`` ranks, and per rank one
page per KV tensor per GPU block (``page_bytes``), ``block_size_factor`` GPU blocks per
CPU block. An engine fits a region when its ranks, its per-layer page sizes and its
blocks per chunk are exactly those; anything else is refused with one error that names
both sides and the ``[instance]``/``[kv]`` lines a matching coordinator config needs
(``tiercache config-for-vllm`` prints a whole config from the model's shape).

No vllm import here: the scheduler and the workers check against it; what vLLM announces
for a model is asked of vLLM (``tiercache.vllm.model_kv``).
"""

from __future__ import annotations

from dataclasses import dataclass

from tiercache.config import Config, KVGeometry, RegionConfig, config_to_toml
from tiercache.errors import ConfigError, LayoutMismatchError
from tiercache.region.layout import RegionLayout
from tiercache.sizes import format_bytes


@dataclass(frozen=True)
class EngineGeometry:
    """What one engine needs of a region. ``page_bytes`` is None where only the total per
    block is known (the scheduler process sees no KV tensors; each worker checks the exact
    pages when it attaches)."""

    world_size: int
    block_size_factor: int
    block_tokens: int
    page_bytes: tuple[int, ...] | None = None
    bytes_per_block: int | None = None  # one rank, all tensors, one GPU block

    def mismatches(self, layout: RegionLayout, config: Config | None = None) -> list[str]:
        """Each difference as 'what: engine X, region Y' (empty when the engine fits)."""
        found = []
        if self.world_size != layout.world_size:
            found.append(f"ranks: engine {self.world_size}, region {layout.world_size}")
        if self.block_size_factor != layout.block_size_factor:
            found.append(f"GPU blocks per chunk: engine {self.block_size_factor}, region "
                         f"{layout.block_size_factor} (kv.block_size_factor)")
        if config is not None and self.block_tokens != config.kv.block_tokens:
            found.append(f"tokens per block: engine {self.block_tokens}, region "
                         f"{config.kv.block_tokens} (kv.block_tokens)")
        if self.page_bytes is not None and self.page_bytes != layout.page_bytes:
            found.append(f"page bytes per tensor: engine {_pages(self.page_bytes)}, region "
                         f"{_pages(layout.page_bytes)}")
        elif self.bytes_per_block and self.bytes_per_block != sum(layout.page_bytes):
            found.append(f"KV bytes per block per rank: engine {self.bytes_per_block}, region "
                         f"{sum(layout.page_bytes)} ({_pages(layout.page_bytes)})")
        return found

    def check(self, layout: RegionLayout, where: str, config: Config | None = None) -> None:
        """Raise ``LayoutMismatchError`` naming every difference and the config that fits."""
        found = self.mismatches(layout, config)
        if found:
            raise LayoutMismatchError(
                f"this vLLM engine does not fit the tiercache region {where}: "
                + "; ".join(found) + ". A coordinator config for this engine needs: "
                + self.config_lines())

    def config_lines(self) -> str:
        kv = (f"page_bytes = {list(self.page_bytes)}" if self.page_bytes is not None else
              f"page_bytes summing to {self.bytes_per_block} per block")
        return (f"[instance] world_size = {self.world_size}; [kv] {kv}, "
                f"block_size_factor = {self.block_size_factor}, block_tokens = {self.block_tokens}")

    def config(self, name: str, capacity_bytes: int) -> Config:
        """A coordinator config for exactly this geometry (needs ``page_bytes``)."""
        if self.page_bytes is None:
            raise ConfigError("a coordinator config needs the page bytes of every KV tensor")
        return Config(name=name, world_size=self.world_size,
                      kv=KVGeometry(page_bytes=self.page_bytes,
                                    block_size_factor=self.block_size_factor,
                                    block_tokens=self.block_tokens),
                      region=RegionConfig(capacity_bytes=capacity_bytes))


def _pages(page_bytes: tuple[int, ...]) -> str:
    sizes = sorted(set(page_bytes))
    if len(sizes) == 1:
        return f"{len(page_bytes)} x {page_bytes[0]} B"
    return "[" + ", ".join(map(str, page_bytes)) + "]"


def coordinator_toml(geometry: EngineGeometry, config: Config, model: str) -> str:
    """The TOML `tiercache serve --config` runs for this engine, with a header comment."""
    layout = RegionLayout.from_config(config)
    head = (f"# tiercache coordinator for vLLM engines of {model}: {geometry.world_size} "
            f"rank(s), {len(geometry.page_bytes or ())} KV tensors of "
            f"{format_bytes(max(geometry.page_bytes or (0,)))} per block per rank, "
            f"{geometry.block_size_factor} block(s) per chunk; {layout.num_blocks} chunks "
            f"({format_bytes(layout.total_bytes)} of /dev/shm)\n"
            f"# serve the engines with --block-size {geometry.block_tokens}: without it vLLM "
            f"takes its attention backend's preferred size (FlashMLA's is 64), and a worker "
            f"whose pages differ is refused at attach\n")
    return head + config_to_toml(config)
