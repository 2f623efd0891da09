"""The cache index: slots, owners and pins (table, manager, owners, caps, recovery), the
tier chain (tiering, feeds; the lower tiers' contract is ``tiercache.tiers.base``), node events."""
