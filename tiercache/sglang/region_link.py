"""``RegionLink``: this SGLang rank's mapping of the coordinator's region, made when there is
one and remade when the coordinator replaces it.

Trust: a region is mapped only if it is ours with mode 0600, checked before its header is
believed (``_check_ours``); anything else under the name is logged and every call misses,
whatever geometry its header claims (a planted file never stops the engine).

At attach (``open``, on SGLang's main thread) the region is mapped if it is there and READY:
the geometry is checked (a mismatch raises ``LayoutMismatchError`` naming both sides and
the config lines that fit: the engine does not start on a misconfiguration) and the
process becomes an attachment of its data rank (``PoolGeometry.data_rank``). A region that
is not there yet (the coordinator is down) is not an error: the link tries again at most
every ``retry_s`` when a call needs it, and calls miss meanwhile. A mismatch found then
(a coordinator started later with another geometry) cannot stop SGLang any more: it is
logged (rate-limited), counted, and every call misses until a region that fits appears.

A coordinator restart normally keeps the region (it re-adopts it: same identity, the
mapping stays valid). When the index hands out a spec of another region identity, the
coordinator replaced the region: the spec is a miss (its slots mean other bytes in the
region this process maps: never a copy) and, if the region now under the name has that
identity, it is attached in the background; the old mapping goes with its last copy.

SGLang's threads never wait for an attach: only ``open`` (SGLang's main thread, at start)
attaches in line; later attaches (the region appeared, or was replaced) run in a thread of
the link's own, since mapping and pre-faulting a large region takes seconds, and calls miss
meanwhile.

Every method may be called from SGLang's three I/O threads at once: one lock guards the
mapping; the copies themselves run outside it, on a ``HostTransfer`` held between
``acquire`` and ``release``. A mapping that is replaced while another thread still copies
through it is closed by that copy's ``release``, never under it.
"""

from __future__ import annotations

import logging
import threading
import time

from tiercache.config import Config
from tiercache.errors import LayoutMismatchError, RegionError, TiercacheError
from tiercache.loglimit import LogLimiter
from tiercache.region.shared import named_region_info
from tiercache.region.shm import SHM_DIR, check_trusted, open_entry
from tiercache.region.stats import EngineKind
from tiercache.sglang.geometry import PoolGeometry
from tiercache.specs import Direction
from tiercache.transfer.host_pages import PageMap
from tiercache.transfer.host_transfer import HostAttachment, HostTransfer

log = logging.getLogger(__name__)


class RegionLink:
    """The mapping of ``config``'s region for an SGLang rank of ``pool`` geometry."""

    def __init__(self, config: Config, pool: PoolGeometry, *, retry_s: float,
                 copy_threads: int, prefault_threads: int):
        self.config, self.pool = config, pool
        self.retry_s = retry_s
        self.copy_threads, self.prefault_threads = copy_threads, prefault_threads
        self._lock = threading.Lock()
        self._transfer: HostTransfer | None = None
        self._retired: list[HostTransfer] = []  # replaced, closed by their last copy
        self._users: dict[int, int] = {}  # id(transfer) -> copies in flight through it
        self._next_try = 0.0
        self._attaching = False
        self._attacher: threading.Thread | None = None
        self._closed = False
        self.mismatch: str | None = None  # why the region there does not fit, if it does not
        self.attach_count = 0
        self._logs = LogLimiter(log, 10.0)

    def open(self) -> None:
        """Attach now if the region is there (a mismatch raises); otherwise later. On
        SGLang's main thread, at start: the one attach that may take its time here."""
        made = self._make(raise_mismatch=True)
        with self._lock:
            self._next_try = time.monotonic() + self.retry_s
            self._install(made)

    def transfer(self) -> HostTransfer | None:
        """The transfer over the current mapping; None while there is none (no region yet,
        none that fits, or one being attached in the background)."""
        with self._lock:
            if self._transfer is None:
                self._attach_soon()
            return self._transfer

    def acquire(self, region_id: int) -> HostTransfer | None:
        """The transfer over the region of identity ``region_id``, held for a copy until
        ``release``; None when the mapping has another identity (the coordinator replaced
        the region: the new one is attached in the background, so this round misses)."""
        with self._lock:
            transfer = self._transfer
            if transfer is None or transfer.attachment.region_id != region_id:
                info = named_region_info(self.config.shm_name)
                if transfer is not None and info is not None and info.region_id == region_id:
                    log.warning("tiercache: the coordinator replaced region %s (identity "
                                "%#018x); re-attaching", self.config.shm_name, region_id)
                    self._drop()
                    self._next_try = 0.0
                    self._attach_soon()
                return None
            self._users[id(transfer)] = self._users.get(id(transfer), 0) + 1
            return transfer

    def release(self, transfer: HostTransfer) -> None:
        """A copy through ``transfer`` is done; a replaced mapping closes with its last."""
        with self._lock:
            left = self._users.pop(id(transfer)) - 1
            if left:
                self._users[id(transfer)] = left
            elif transfer in self._retired:
                self._retired.remove(transfer)
                _close(transfer)

    def record_failure(self, direction: Direction) -> None:
        """Count a transfer that failed before any copy (coordinator gone, no room) in the
        current attachment's stats block (under the lock: the mapping cannot go meanwhile)."""
        with self._lock:
            if self._transfer is not None:
                self._transfer.attachment.stats.record_transfer(direction, 0, 0.0, False)

    def wait_attached(self, timeout_s: float) -> bool:
        """Whether a mapping is there within ``timeout_s`` (tests, tools; never SGLang's
        threads)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.transfer() is not None:
                return True
            time.sleep(0.01)
        return False

    def _attach_soon(self) -> None:
        """Start attaching in a thread of our own when due (under the lock): mapping and
        pre-faulting a large region takes seconds, which SGLang's threads never wait for."""
        if self._attaching or self._closed or time.monotonic() < self._next_try:
            return
        self._attaching = True
        self._next_try = time.monotonic() + self.retry_s
        thread = threading.Thread(target=self._attach_in_background, daemon=True,
                                  name="tiercache-attach")
        self._attacher = thread
        thread.start()

    def _attach_in_background(self) -> None:
        try:
            made = self._make(raise_mismatch=False)
        except Exception:  # never out of our thread: logged, retried after retry_s
            log.exception("tiercache: attaching region %s failed", self.config.shm_name)
            made = None
        with self._lock:
            self._attaching = False
            if self._closed:
                if made is not None:
                    _close(made)
                return
            self._install(made)

    def _install(self, made: HostTransfer | None) -> None:
        if made is not None:
            self._drop()
            self._transfer = made
            self.attach_count += 1

    def _make(self, raise_mismatch: bool) -> HostTransfer | None:
        """Map the region under the name if it is there, ours and fits; None otherwise
        (logged), or ``LayoutMismatchError`` with ``raise_mismatch``. Takes no lock."""
        info = named_region_info(self.config.shm_name)
        if info is None:
            return None  # no READY region yet: the coordinator is down; retried later
        try:
            _check_ours(self.config.shm_name)  # before its header is believed: not ours, not read
            layout = info.layout
            self.pool.check(layout, f"{SHM_DIR}/{self.config.shm_name}")
            page_map = PageMap.onto(self.pool.blob_bytes, layout)
            attachment = HostAttachment.attach(self.config.shm_name, self.pool.data_rank(layout),
                                               layout=layout,
                                               prefault_threads=self.prefault_threads,
                                               engine=(EngineKind.SGLANG, self.pool.tp_rank,
                                                       self.pool.tp_size))
        except LayoutMismatchError as e:
            self.mismatch = str(e)
            if raise_mismatch:
                raise
            self._logs.warn("mismatch", "tiercache: %s; every lookup misses until a region "
                            "that fits is served", e)
            return None
        except (RegionError, TiercacheError, OSError) as e:
            self._logs.warn("attach", "tiercache: cannot attach region %s yet: %s",
                            self.config.shm_name, e)
            return None
        try:
            made = HostTransfer(attachment, page_map, self.copy_threads)
        except BaseException:
            attachment.close()
            raise
        self.mismatch = None
        log.info("tiercache: SGLang TP rank %d attached %s as an attachment of rank %d "
                 "(slot %s; pages of %d bytes; host-to-host copies, pin state not_needed)",
                 self.pool.tp_rank, attachment.region.path, attachment.rank,
                 attachment.region.slot, self.pool.page_bytes)
        return made

    def _drop(self) -> None:
        """Forget the current mapping: closed now, or by the last copy still using it."""
        old, self._transfer = self._transfer, None
        if old is None:
            return
        if self._users.get(id(old)):
            self._retired.append(old)
        else:
            _close(old)

    def close(self) -> None:
        """At detach (SGLang has stopped its I/O threads: no copy is in flight); an attach
        still running in the background closes what it makes."""
        with self._lock:
            self._closed = True
            self._drop()
            for old in self._retired:
                _close(old)
            self._retired = []
            self._users.clear()


def _check_ours(shm_name: str) -> None:
    """``RegionTrustError`` unless the region under ``shm_name`` is ours with mode 0600: a
    file another user planted under the name is never mapped, and its header (which could
    claim any geometry) never stops the engine."""
    entry = open_entry(shm_name, writable=False)
    try:
        check_trusted(entry)
    finally:
        entry.close()


def _close(transfer: HostTransfer) -> None:
    try:
        transfer.close()
    finally:
        transfer.attachment.close()
