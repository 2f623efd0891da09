"""The cache index: slots, owners and pins (table, manager, owners, caps, recovery), the
tier chain and its one-way lower-tier contract (tiering, feeds, lower_tier), node events."""
