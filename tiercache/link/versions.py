"""Which control-protocol versions meet, and how two that do not meet say so.

**The rule: a coordinator of version N serves engines of N and N−1** (``SERVED_VERSIONS``);
an engine speaks exactly its own ``PROTOCOL_VERSION``. So a node upgrades its coordinator
first and its engines after, one release at a time (docs/deploy.md, "Upgrades and version
skew"). A change to any payload bumps N and keeps what N−1 needs beside it: a verb N−1
lacks or reads another way is refused to it (``VERB_SINCE``), an error code it does not
know reaches it as code 1 with the same message (``ERROR_CODE_SINCE``).

**The version is fixed by the connection's first frame** (HELLO): every later frame must
carry it (another is a bad frame: the connection is closed) and every answer carries it,
so an N−1 engine reads only frames of its own version. A first frame of a version not
served is refused, and nothing of its payload is read: the coordinator answers one
``ProtocolError`` naming both versions and what to upgrade, logs the same line, and closes.

**Frozen in every version** — what lets any two versions tell each other no:

* the 16-byte frame header (``FrameHeader``: magic, version, verb, status, request id,
  length);
* a refusal of the connection: request id 0, ``Status.ERROR``, verb HELLO (11), sent *in
  the engine's version* so the engine decodes it as it decodes any answer;
* the ERROR payload (u32 code, str message) and code 6, ``ProtocolError``.

So an engine of any version gets the coordinator's one line as the exception of its
HELLO. (Coordinators before this rule closed a foreign version without an answer: the
engine's ``Client`` then names the likely reason in its ``CoordinatorGoneError``.)

Protocol 8 against 9: 9 added DESCRIBE, and a TIER_STATS answer of 9 carries one field
more than some trees of 8 read (``held_buffers``), so both are refused to 8; error code 10
(``NamespaceError``) came with 9. The other verbs are byte for byte the same.
"""

from __future__ import annotations

from tiercache.link.protocol import PROTOCOL_VERSION, Verb
from tiercache.errors import ProtocolVersionError

SERVED_VERSIONS = (PROTOCOL_VERSION - 1, PROTOCOL_VERSION)
# The first version that speaks each verb as this coordinator does (absent: every served one).
VERB_SINCE = {Verb.DESCRIBE: 9, Verb.TIER_STATS: 9}
# The first version that knows each error code (absent: every served one).
ERROR_CODE_SINCE = {10: 9}
_UNEXPECTED_CODE = 1  # TiercacheError: every version knows it


def check_served(version: int) -> None:
    """Raise ``ProtocolVersionError`` (one line) unless a coordinator serves ``version``."""
    if version in SERVED_VERSIONS:
        return
    served = " and ".join(str(v) for v in SERVED_VERSIONS)
    upgrade = ("upgrade the coordinator first (it serves its own version and the one "
               "before)" if version > PROTOCOL_VERSION else
               "upgrade the engine's tiercache to this coordinator's release or the one "
               "before it")
    raise ProtocolVersionError(
        f"engine speaks control protocol {version}; this coordinator serves protocol "
        f"{served}: {upgrade} (docs/deploy.md, \"Upgrades and version skew\")")


def check_verb(verb: Verb, version: int) -> None:
    """Raise ``ProtocolVersionError`` if a connection of ``version`` may not ask ``verb``."""
    since = VERB_SINCE.get(verb, 0)
    if version < since:
        raise ProtocolVersionError(f"{verb.name} is served to control protocol {since} and "
                                   f"later; this connection speaks {version}")


def error_code_for(code: int, version: int) -> int:
    """The code to send a connection of ``version`` for an error of wire code ``code``."""
    return code if version >= ERROR_CODE_SINCE.get(code, 0) else _UNEXPECTED_CODE
