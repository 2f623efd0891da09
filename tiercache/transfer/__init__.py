"""The worker: what a rank runs to move its blocks (the top of the worker wing).

``worker.attach`` maps and page-locks the rank's slice and builds both handlers over the
engine's KV caches (``kv_caches``); ``handlers`` order, track and report transfers; each
handler hands its transfers to one ``path.TransferPath``: the native path (one native
call per transfer, ``native_path``) or the planned one (plan -> fence -> mark -> submit,
``planned_path``), chosen by ``wiring``; ``fence`` is what a transfer is checked against
before a byte moves (the region's identity, each slot's generation).
"""
