"""Eviction policies: which cached blocks to give up when the index needs room, behind one
small contract (``base.EvictionPolicy``) and a registry (``POLICIES``): ``lru``, ``arc``.
They order slot ids (``recency.RecencyOrder``: a stamp a slot); keys, states and sessions
are the index's (``tiercache.index``)."""

from __future__ import annotations

from tiercache.eviction import arc, lru
from tiercache.eviction.base import POLICIES, CanEvict, EvictionPolicy, make_policy, register_policy

ARCPolicy, LRUPolicy = arc.ARCPolicy, lru.LRUPolicy

__all__ = ["POLICIES", "ARCPolicy", "CanEvict", "EvictionPolicy", "LRUPolicy", "make_policy",
           "register_policy"]
