"""Telling systemd where the coordinator is (``Type=notify`` units, ``sd_notify(3)``).

``tiercache serve`` under ``deploy/systemd/tiercache@.service`` sends ``READY=1`` once
the region is READY and the control socket answers, so engine units ordered ``After=`` it
start against a live cache, and ``STOPPING=1`` when it shuts down. Outside systemd
(``NOTIFY_SOCKET`` unset) nothing is sent.

Trust: ``NOTIFY_SOCKET`` comes from whoever started us (systemd); we only send to it, one
datagram of fixed words, and never read from it. A send that fails is logged (a
``Type=notify`` unit then times out at start, which is visible), never raised: the
coordinator serves whether or not a supervisor listens.
"""

from __future__ import annotations

import logging
import os
import socket

log = logging.getLogger(__name__)

NOTIFY_ENV = "NOTIFY_SOCKET"


def notify(*words: str) -> bool:
    """Send ``words`` (e.g. ``"READY=1"``) to the supervisor; False if there is none or the
    send failed (logged)."""
    path = os.environ.get(NOTIFY_ENV)
    if not path:
        return False
    address = "\0" + path[1:] if path.startswith("@") else path  # '@': abstract namespace
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto("\n".join(words).encode(), address)
    except OSError as e:
        log.warning("could not tell the supervisor %s at %s=%s: %s", "/".join(words),
                    NOTIFY_ENV, path, e)
        return False
    return True
