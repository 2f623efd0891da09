"""Every cheap precondition of ``tiercache serve``, checked before anything is allocated.

Allocating a large region takes seconds to minutes; a port someone else holds, a disk
directory of the wrong owner or a key file others can read must not cost that wait, nor
leave anything behind. So the coordinator's start first checks what its later steps
would refuse for a cheap reason, creating nothing, in this order (the first refusal is
the one line the operator reads):

1. the region's name (``region.claim.check_claimable``): nothing there that is not ours,
   no live coordinator; the key presence map's name beside it likewise;
2. the control socket (``SocketFile.check``): its path's length, its directory (trusted,
   or one we can create), no live process serving it;
3. the exporter's port: bound and listening now, and *kept* (``take_exporter_listener``
   hands it to the exporter), so nobody can take it between this check and the start;
   scrapers that connect meanwhile wait in its backlog;
4. the event stream's endpoints: each one's port bound and released again (ZMQ binds its
   own sockets later; port 0 picks a free one and is not checked);
5. each configured lower tier's checker (``tiercache.tiers.TIER_CHECKS``): the disk
   tier's directory, the file under its name and the room it needs, the cluster's key.

What is left for the start to find is what only doing it tells: room in ``/dev/shm``
(``SharedOffloadRegion.create`` checks it right before it creates the region, after any
stale region of the name is gone), the pool's master, a race with another process.
"""

from __future__ import annotations

import socket

from tiercache.config import Config
from tiercache.config.events import tcp_address
from tiercache.errors import ConfigError


class Preflight:
    """The checks above, run by ``run``; holds the exporter's listening socket until the
    exporter takes it or ``close`` frees it."""

    def __init__(self, exporter_listener: socket.socket | None):
        self._exporter_listener = exporter_listener

    @classmethod
    def run(cls, config: Config) -> Preflight:
        """Check everything (module docstring); raise the first refusal, holding nothing."""
        from tiercache.link.sockets import SocketFile, trusted_uids
        from tiercache.metrics.exporter import bind_listener
        from tiercache.region.claim import check_claimable
        from tiercache.region.layout import RegionLayout
        from tiercache.region.presence import WHAT, presence_shm_name
        from tiercache.tiers import check_tier, configured_tiers

        layout = RegionLayout.from_config(config)
        check_claimable(config.shm_name)
        check_claimable(presence_shm_name(config.name), WHAT)
        trusted = config.control_trusted_uid
        SocketFile(config.socket_path, trusted_uids(trusted if trusted >= 0 else None),
                   backlog=1).check()
        listener = bind_listener(config.exporter) if config.exporter.enabled else None
        try:
            if config.events is not None:
                for key, endpoint in config.events.endpoints.items():
                    check_bindable(key, endpoint)
            for name in configured_tiers(config):
                check_tier(name, config, layout)
        except BaseException:
            if listener is not None:
                listener.close()
            raise
        return cls(listener)

    def take_exporter_listener(self) -> socket.socket | None:
        """The exporter's bound, listening socket (None with the exporter off); the caller
        owns it from now on."""
        listener, self._exporter_listener = self._exporter_listener, None
        return listener

    def close(self) -> None:
        """Free what was not taken. Idempotent."""
        if self._exporter_listener is not None:
            self._exporter_listener.close()
            self._exporter_listener = None


def check_bindable(key: str, endpoint: str) -> None:
    """``ConfigError`` naming ``key`` unless a TCP socket can bind ``endpoint``'s address
    and port now (a port another process listens on cannot be)."""
    address, port = tcp_address(endpoint)
    if port == 0:
        return
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as ZMQ binds
        try:
            probe.bind((address, port))
        except OSError as e:
            raise ConfigError(f"{key} = {endpoint!r}: cannot bind it ({e.strerror or e}); "
                              "give a free port, or port 0 for any free one") from e
