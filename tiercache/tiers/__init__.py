"""Tiers below host memory, owned by the coordinator (it maps the region): each a one-way
``LowerTier`` (the contract: ``base``) that the index's tier chain drives.

``TIER_FACTORIES`` is the registry, fastest tier first: a config section name ->
``"module:callable"``, the callable building the tier from the config, the coordinator's
region and a progress printer (``build(config, region, say) -> LowerTier``).
``TIER_CHECKS`` names each tier's cheap preconditions, which the coordinator runs before
it allocates anything (``check(config, layout)``). Modules are imported only when their
section is configured (Mooncake's client never loads without a ``[cluster]``). A new tier
is a module and a line in each registry; the coordinator names none.

* ``disk_file`` / ``disk``: the local disk tier's slot file and the tier;
* ``cluster_object`` / ``cluster_transfer`` / ``mooncake_pool`` / ``cluster``: the
  cluster pool's object format, its batched moves, the only module importing mooncake,
  and the tier;
* ``pump``: ``JobPump``, the job queues and threads every tier serves its jobs on;
* ``builders``: each tier built from its config section.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tiercache.config import Config
from tiercache.tiers.base import LowerTier

if TYPE_CHECKING:
    from tiercache.region.layout import RegionLayout
    from tiercache.tiers.builders import TierRegion

TIER_FACTORIES: dict[str, str] = {
    "disk": "tiercache.tiers.builders:build_disk",
    "cluster": "tiercache.tiers.builders:build_cluster",
}
# each tier's cheap preconditions, checked before the coordinator allocates anything
# (``check(config, layout)``, raising what its factory would raise for them)
TIER_CHECKS: dict[str, str] = {
    "disk": "tiercache.tiers.builders:check_disk",
    "cluster": "tiercache.tiers.builders:check_cluster",
}


def configured_tiers(config: Config) -> list[str]:
    """The configured tiers' section names, fastest first."""
    return [name for name in TIER_FACTORIES if getattr(config, name) is not None]


def _resolve(target: str) -> Callable[..., Any]:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def check_tier(name: str, config: Config, layout: RegionLayout) -> None:
    _resolve(TIER_CHECKS[name])(config, layout)


def build_tier(name: str, config: Config, region: TierRegion, say: Callable[[str], None],
               ) -> LowerTier:
    tier: LowerTier = _resolve(TIER_FACTORIES[name])(config, region, say)
    return tier
