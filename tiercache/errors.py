"""The one exception hierarchy of tiercache.

Every error tiercache raises on purpose is a ``TiercacheError``; OS and CUDA
errors are re-raised as one of these with the original as ``__cause__``.

::

    TiercacheError
    ├── ConfigError                 bad config file, key, type or value   (also ValueError)
    │   ├── UnsupportedModelError   a model whose KV layout tiercache cannot serve (the
    │   │                           config commands name the model and why)
    │   └── TraceError              a replay trace line that is not a request (file and
    │                               line named)
    ├── ArgumentError               a call with an argument the API does not allow: wrong
    │                               type, out of range, inconsistent      (also ValueError)
    ├── RegionError                 the shared-memory region
    │   ├── RegionExistsError       a live coordinator already owns the name
    │   ├── RegionNotFoundError     no region of that name
    │   ├── RegionNotReadyError     header not READY (yet, or any more)
    │   ├── RegionTrustError        the name holds something we must not use: not a regular
    │   │                           file, or not ours with mode 0600
    │   ├── RegionTruncatedError    the region file is shorter than its header says (or
    │   │                           than the header itself): cut short, it cannot be mapped
    │   ├── LayoutMismatchError     the region has a different geometry or format than
    │   │                           the caller expects
    │   ├── RankError               rank outside 0..world_size-1          (also ValueError)
    │   ├── StatsStuckError         a rank's stats block stayed mid-update (also TimeoutError)
    │   ├── InsufficientMemoryError /dev/shm or RAM smaller than asked for
    │   └── NumaError               a NUMA call (mbind, get_mempolicy, move_pages) failed or
    │                               is not wired for this machine (the errno named)
    ├── PinError                    cuMemHostRegister failed (rolled back)
    │   └── PinUnavailableError     no CUDA here: nothing can be pinned
    ├── SpecError                   a transfer spec that cannot be planned (also ValueError)
    ├── BackendError                a copy backend cannot run here or failed to set up
    ├── HandlerError                a transfer handler used against its contract: a handler
    │   │                           of the wrong direction, negative result figures
    │   ├── HandlerClosedError      a transfer submitted after shutdown()
    │   └── TransferFailedError     a transfer failed where the engine cannot recover one
    │                               (vLLM): the engine stops with it, never a wrong block
    ├── AdapterError                an engine adapter's own thread stopped on an error (the
    │                               cause attached), raised in the engine's thread
    ├── ManagerError                cache-index misuse
    │   ├── UnknownKeyError         a key the index does not hold         (also KeyError)
    │   ├── InvalidKeyError         a key that is not bytes, too long for the wire, or
    │   │                           repeated in one prepare_store         (also ValueError)
    │   ├── StateError              a call out of order: double complete, load of a
    │   │                           block being written, ref-count underflow
    │   ├── SessionLimitError       a session would hold more blocks than
    │   │                           index.max_session_blocks
    │   └── NamespaceError          a store under a namespace of the event stream that the
    │                               storing session did not describe (DESCRIBE)
    ├── TierError                   a tier below host memory (disk) cannot be used as asked
    ├── JobError                    the completion loop misused: a repeated job id or ack
    │   └── RanksDownError          a job begun while a rank is down (restart it, retry)
    ├── WorkerError                 a worker process failed to start or stopped answering
    ├── EngineDependencyError       engine-side code run without torch, which the engine's
    │                               environment brings (the coordinator installs without
    │                               it)                                  (also ImportError)
    ├── ProtocolError               a malformed, oversized or unexpected frame
    │   └── ProtocolVersionError    the peer speaks a protocol version this side does not
    │                               serve (refused at HELLO), or a verb its version lacks
    ├── ControlSocketError          the control socket path cannot be served (in use, bad path)
    ├── CoordinatorGoneError        the control socket is closed or missing (also ConnectionError)
    │   └── SessionLostError        the coordinator no longer knows this client's session
    │                               (declared dead, or its region was replaced): what it
    │                               held is gone; the client now has a new session
    └── ServiceError                `tiercache serve` did not start, or its exporter did not stop
"""

from typing import Self


class TiercacheError(Exception):
    """Base of every error tiercache raises on purpose."""


class ConfigError(TiercacheError, ValueError):
    """A config file, key, type or value that is not allowed; the message names it."""


class UnsupportedModelError(ConfigError):
    """A model whose KV-cache layout tiercache cannot serve; the message names the model, the
    layers at fault and why."""


class TraceError(ConfigError):
    """A ``tiercache replay`` trace that cannot be read: the file, line and field named."""


class ArgumentError(TiercacheError, ValueError):
    """A call with an argument the API does not allow; the message names it and what is."""


class RegionError(TiercacheError):
    """The shared-memory region could not be created, attached or used."""


class RegionExistsError(RegionError):
    """A live coordinator already owns a region of this name."""


class RegionNotFoundError(RegionError):
    """No region of this name exists in /dev/shm."""


class RegionNotReadyError(RegionError):
    """The region exists but its header is not READY (still being created, or closing)."""


class RegionTrustError(RegionError):
    """The region's name holds something tiercache must not use: a FIFO, directory, symlink
    or device, or a file that is not owned by this user with mode 0600."""


class RegionTruncatedError(RegionError):
    """The region file is shorter than the ``total_bytes`` its header records, or than the
    fixed header itself: mapping it would fault. A stale one is replaced by ``serve`` and
    removed by ``clean``."""


class LayoutMismatchError(RegionError):
    """The region's format or geometry differs from what the caller expects (bad arguments
    are an ``ArgumentError``; this is about the region found)."""


class RankError(RegionError, ValueError):
    """A rank outside ``0 .. world_size - 1``."""


class StatsStuckError(RegionError, TimeoutError):
    """A rank's stats block stayed mid-update: its writer died between the two sequence
    bumps. The next writer of that rank repairs it."""


class InsufficientMemoryError(RegionError):
    """/dev/shm or host memory is smaller than the region; the message gives both numbers."""


class NumaError(RegionError):
    """A NUMA memory-policy call on the region (``mbind``, ``get_mempolicy``, ``move_pages``)
    failed, or is not wired for this architecture; the message names the call, the range
    or node and the errno (``EPERM`` in a container without ``CAP_SYS_NICE`` is common)."""


class PinError(TiercacheError):
    """Registering host memory with the GPU driver failed; the ranges registered before it
    were rolled back."""


class PinUnavailableError(PinError):
    """Pinning is impossible in this process (no CUDA device or a CPU-only torch)."""


class SpecError(TiercacheError, ValueError):
    """A transfer spec that cannot be planned: ids out of range, sizes that do not add up."""


class BackendError(TiercacheError):
    """A copy backend cannot run on this host or failed to set up."""


class HandlerError(TiercacheError):
    """A transfer handler (``tiercache.transfer.handlers``) used against its contract."""


class HandlerClosedError(HandlerError):
    """A transfer submitted to a handler after ``shutdown()``: a state error, not a
    backend's: nothing was planned or enqueued."""


class TransferFailedError(HandlerError):
    """A transfer failed, and the engine has no failure path for it (vLLM 0.33 asserts
    every transfer succeeded): raised so the engine stops, rather than compute on a block
    that was not loaded or publish one that was not stored; the message names the job,
    its direction, size and rank."""


class AdapterError(TiercacheError):
    """An engine adapter's own thread (vLLM's flusher) stopped on an error, kept as the
    cause and raised in the engine's thread at its next call: the engine stops with it
    instead of waiting for answers that will not come."""


class ManagerError(TiercacheError):
    """The cache index was used against its contract."""


class UnknownKeyError(ManagerError, KeyError):
    """A key the index does not hold."""

    def __str__(self) -> str:  # KeyError quotes its argument; keep the message readable
        return str(self.args[0]) if self.args else ""


class InvalidKeyError(ManagerError, ValueError):
    """A key that is not ``bytes``, too long for the wire, or repeated in one ``prepare_store``."""


class StateError(ManagerError):
    """A call out of order for a block's state (double complete, underflow, ...)."""


class SessionLimitError(ManagerError):
    """A session asked to hold more blocks than ``index.max_session_blocks`` allows."""


class NamespaceError(ManagerError):
    """A session stored keys under a namespace the node's event stream publishes that it did
    not describe itself (``tiercache.events.namespace_table``)."""


class JobError(TiercacheError):
    """The completion loop (``tiercache.link.jobs``) used against its contract."""


class RanksDownError(JobError):
    """A job cannot begin while these ranks are down; restart them and retry."""

    def __init__(self, ranks: list[int]):
        super().__init__(f"rank(s) {ranks} are down; requests wait until they re-attach")
        self.ranks = ranks


class WorkerError(TiercacheError):
    """A worker process (one rank of an engine) failed to start or stopped answering."""


class EngineDependencyError(TiercacheError, ImportError):
    """Engine-side code (a worker's ``attach``, the demo's ranks) imported where torch is
    missing. torch is not a dependency of the package: ``tiercache serve`` never imports it,
    and an engine brings its own build (CUDA or not); ``pip install 'tiercache[engine]'``
    adds one where there is none."""

    @classmethod
    def torch_for(cls, what: str) -> Self:
        return cls(f"{what} needs torch (the engine's own; pip install 'tiercache[engine]')",
                   name="torch")


class ProtocolError(TiercacheError):
    """A control-plane frame that is malformed, oversized or not expected."""


class ProtocolVersionError(ProtocolError):
    """The two ends' protocol versions do not meet (``tiercache.link.versions``): the
    engine's HELLO is refused in one line naming both, or a verb is newer than the
    connection's version. On the wire it is a ``ProtocolError`` (code 6), which every
    version reads."""


class ControlSocketError(TiercacheError):
    """The control socket cannot be served: a live server owns the path, or the path is unusable."""


class TierError(TiercacheError):
    """A tier below host memory cannot be used as asked (a key too long for it, ...)."""


class CoordinatorGoneError(TiercacheError, ConnectionError):
    """The coordinator's control socket is closed or missing; retry once it is back."""


class SessionLostError(CoordinatorGoneError):
    """The coordinator no longer knows this client's session: it was declared dead (silent
    past ``index.session_timeout_s``) or its region was replaced. What the session held is
    gone; the client is connected again with a new session, as after a coordinator restart
    that kept nothing."""


class ServiceError(TiercacheError):
    """``tiercache serve`` did not come up (exited, or not ready in time), or its exporter
    could not stop cleanly (a scrape still ran)."""
