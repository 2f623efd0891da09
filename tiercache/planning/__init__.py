"""Planning: a transfer's specs checked once and turned into the plan a backend moves.

``geometry.TransferGeometry`` is a rank's pages and KV-cache groups, a frozen value fixed
at attach (what backends get instead of the planner). ``planner.TransferPlanner`` (per
rank, over one geometry) validates a (src_spec, dst_spec) pair against it and emits one
of the two plan forms of ``plans``: a ``CopyPlan`` (merged page descriptors) or a
``BlockPlan`` (validated block pairs, which ``staged`` expands to pages on the device).
``page_groups`` holds each KV-cache group's geometry and writes its descriptors; ``runs``
merges them. Block plans are validated in C (``tiercache.native.validator``: the
planner's accelerator, the same rules). Pure numpy: nothing here knows devices, streams
or backends.
"""
