"""Tiers below host memory, owned by the coordinator (it maps the region): each a one-way
``LowerTier`` (``tiercache.index.lower_tier``) that the index's tier chain drives.

``TIER_FACTORIES`` is the registry, fastest tier first: a config section name ->
``"module:callable"``, the callable building the tier from the config, the coordinator's
region and a progress printer (``build(config, region, say) -> LowerTier``). Modules are
imported only when their section is configured (Mooncake's client never loads without a
``[cluster]``). A new tier is a module and a line here; the coordinator names none.

* ``disk_file`` / ``disk``: the local disk tier's slot file and the tier;
* ``cluster_object`` / ``cluster_transfer`` / ``mooncake_pool`` / ``cluster``: the
  cluster pool's object format, its batched moves, the only module importing mooncake,
  and the tier;
* ``builders``: each tier built from its config section.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING

from tiercache.config import Config
from tiercache.index.lower_tier import LowerTier

if TYPE_CHECKING:
    from tiercache.tiers.builders import TierRegion

TIER_FACTORIES: dict[str, str] = {
    "disk": "tiercache.tiers.builders:build_disk",
    "cluster": "tiercache.tiers.builders:build_cluster",
}


def configured_tiers(config: Config) -> list[str]:
    """The configured tiers' section names, fastest first."""
    return [name for name in TIER_FACTORIES if getattr(config, name) is not None]


def build_tier(name: str, config: Config, region: TierRegion, say: Callable[[str], None],
               ) -> LowerTier:
    module, _, attr = TIER_FACTORIES[name].partition(":")
    return getattr(importlib.import_module(module), attr)(config, region, say)
