"""This worker process's identity and heartbeat: what tells other workers its runs are alive.

A run row names the process that runs its body (``host:pid:random``: the random part
tells a pid reused after a restart from the one before). That process refreshes its row in
``cluster_beat_workers`` from a daemon thread of its own, started when the process first
opens the ledger store (so after the prefork pool forks: each pool child heartbeats for
itself, and a child that dies stops heartbeating with it). Every ``grace / 4`` seconds it
says "alive for ``grace`` more seconds" by the database's clock, so a run is taken over only
once its process missed about four heartbeats, or its worker's main process recorded it gone
(:mod:`.outcomes`). ``grace`` is the app's ``cluster_beat_worker_grace`` (default 45 s).

A heartbeat that fails is tried again after :data:`RETRY_PAUSE` (1 s), not a whole interval
later, and logs once per outage. One database call can block for up to
``cluster_beat_db_timeout`` (the store has no shorter bound per call), so a failover costs a
heartbeat up to two such calls (the one cut off and the retry that gets through) on top of
the interval since the last one: :func:`worker_grace` therefore requires
``grace >= 2 * db_timeout + grace / 4`` and refuses a smaller one with a
:class:`~..errors.ConfigError` naming ``cluster_beat_worker_grace``, at the first ledger use
in each process (a worker would otherwise look dead during every failover; a silently
raised grace would re-run dead runs later than configured). Unset, the grace is 45 s or that
minimum, whichever is more. Past ``grace`` without a heartbeat its runs may be taken over by
a redelivery (as a beat node's claims are when its heartbeat stops).

Deferred finishes (:func:`defer`) are written *before* each heartbeat, and a heartbeat is
written only once they all went through: after an outage the first thing the database learns
is that those runs ended, so a "check later" copy or redelivery arriving meanwhile never
takes a run that already finished for a dead one and re-runs it.

When the database says this process is gone (its worker's main process or a take-over of
one of its runs recorded it so: a heartbeat answers False, ``start_run`` raises
:class:`~..store.liveness.ProcessGone`), the process takes a new identity
(:func:`renew_identity`) and heartbeats under it: its old name stays dead for good, and the
heartbeat thread never stops for it. A heartbeat after a mere expiry (an outage) refreshes the
row: runs nobody took over stay this process's, alive.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from ..base import MAX_NODE_ID_LENGTH
from ..config.settings import db_timeout_setting
from ..errors import ConfigError
from ..store import ClaimStore, StoreUnavailable
from ..store.dialects.base import new_token

logger = logging.getLogger("celery_cluster_beat.worker")

#: Seconds a worker process counts as alive after its last heartbeat, unless the app's
#: ``cluster_beat_worker_grace`` says otherwise.
DEFAULT_GRACE = 45.0
#: Heartbeats per grace.
BEATS_PER_GRACE = 4
#: Seconds before a failed heartbeat is tried again.
RETRY_PAUSE = 1.0
#: How often the heartbeat thread deletes rows of processes long gone (seconds).
PRUNE_EVERY = 3600.0

_identities: Dict[int, str] = {}
#: Writes that failed in a task (a finish the database did not take): the heartbeat thread
#: retries them until they go through, so a run whose end was not recorded does not read
#: as running for as long as this process lives.
_deferred: List[Callable[[], Any]] = []
_threads: Dict[int, "Heartbeat"] = {}
_lock = threading.Lock()
_identity_lock = threading.Lock()


def min_grace(db_timeout: float) -> float:
    """The least grace that outlasts a heartbeat's worst failover: ``2 * db_timeout + grace / 4``."""
    return 2.0 * db_timeout * BEATS_PER_GRACE / (BEATS_PER_GRACE - 1)


def worker_grace(app: Any) -> float:
    """The app's ``cluster_beat_worker_grace`` in seconds, checked against ``cluster_beat_db_timeout``
    (module docstring): a :class:`ConfigError` naming the setting when it is not a positive number
    or too small to outlast one database failover. Unset: :data:`DEFAULT_GRACE` or that minimum."""
    least = min_grace(db_timeout_setting(app.conf))
    raw = app.conf.get("cluster_beat_worker_grace")
    if raw is None:
        return max(DEFAULT_GRACE, least)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = float("nan")
    if not (0 < value < 86400 * 365):  # also refuses nan and inf
        raise ConfigError(f"setting cluster_beat_worker_grace: expected a positive number of seconds, got {raw!r}")
    if value < least:
        raise ConfigError(
            f"setting cluster_beat_worker_grace: {value:g}s is too short for cluster_beat_db_timeout "
            f"{db_timeout_setting(app.conf):g}s: it must be at least {least:.4g}s (grace >= 2 x db_timeout + "
            f"grace/{BEATS_PER_GRACE}), or a database failover makes every worker process look dead")
    return value


def host_name() -> str:
    """This host's name as the heartbeat rows and a worker's main process know it."""
    return socket.gethostname()


def _new_identity(pid: int) -> str:
    tail = f":{pid}:{new_token()[:8]}"
    return host_name()[: MAX_NODE_ID_LENGTH - len(tail)] + tail


def process_id() -> str:
    """This process's id for run rows and heartbeats: ``host:pid:random`` within the column width
    (the host part is cut, never the pid or the random part). Made under a lock, so threads of one
    process never run under two ids (one of which nobody would heartbeat)."""
    pid = os.getpid()
    ident = _identities.get(pid)
    if ident is None:
        with _identity_lock:
            ident = _identities.get(pid)
            if ident is None:
                ident = _identities[pid] = _new_identity(pid)
    return ident


def renew_identity(gone: str) -> str:
    """This process was recorded gone under *gone*: take a new identity (unless another thread did
    already) and return the current one. The old name stays dead; the heartbeat thread writes the
    new one's row at its next beat (``start_run`` writes it too)."""
    pid = os.getpid()
    with _identity_lock:  # not _lock: start_heartbeat holds that during the first beat
        if _identities.get(pid) == gone:
            fresh = _identities[pid] = _new_identity(pid)
            logger.error("cluster-beat ledger: worker process %s was recorded gone (a run of it was taken over "
                         "after its heartbeat expired, or its worker saw it die); it goes on as %s", gone, fresh)
    return process_id()


class Heartbeat(threading.Thread):
    """The daemon thread that keeps this process's heartbeat row fresh."""

    def __init__(self, store: ClaimStore, grace: float) -> None:
        super().__init__(name="cluster-beat-heartbeat", daemon=True)
        self.store = store
        self.grace = grace
        self.pid = os.getpid()
        self.stopped = threading.Event()
        self._failing = False
        self._pruned_at: Optional[float] = None

    @property
    def process(self) -> str:
        """This process's current identity (it changes when the database recorded it gone)."""
        return process_id()

    def beat(self) -> bool:
        """Deferred finishes first, then one heartbeat (under a new identity when the database says
        this one is gone); False when the database did not answer."""
        try:
            flush_deferred()
            for _ in range(2):
                process = self.process
                if self.store.worker_heartbeat(process, host=host_name(), pid=self.pid, grace=self.grace):
                    break
                renew_identity(process)  # recorded gone: a new name, whose first heartbeat is next
        except StoreUnavailable as exc:
            if not self._failing:
                logger.warning("cluster-beat ledger: worker process %s cannot heartbeat (%s); retrying every "
                               "%gs; past %gs its runs may be taken over", self.process, exc, RETRY_PAUSE,
                               self.grace)
            self._failing = True
            return False
        if self._failing:
            logger.info("cluster-beat ledger: worker process %s heartbeats again", self.process)
            self._failing = False
        if self._pruned_at is None or time.monotonic() - self._pruned_at > PRUNE_EVERY:
            self._pruned_at = time.monotonic()
            try:
                self.store.prune_workers()
            except StoreUnavailable:
                pass
        return True

    def run(self) -> None:
        interval = self.grace / BEATS_PER_GRACE
        wait = interval
        while not self.stopped.wait(wait):
            wait = interval if self.beat() else RETRY_PAUSE


def flush_deferred() -> None:
    """Write the deferred finishes, oldest first; StoreUnavailable when the database stops answering."""
    while _deferred:
        try:
            _deferred[0]()
        except StoreUnavailable:
            raise
        except Exception:  # pragma: no cover  (a bug must not stop the heartbeat)
            logger.exception("cluster-beat ledger: a deferred ledger write failed")
        _deferred.pop(0)


def defer(write: Callable[[], Any]) -> None:
    """Have the heartbeat thread retry *write* until the database takes it."""
    _deferred.append(write)


def start_heartbeat(store: ClaimStore, app: Any) -> None:
    """Start this process's heartbeat (once per process; after a fork the child starts its own).

    The first heartbeat is written before this returns, so no run can name a process the
    database has not heard of (a run under an unknown process would read as gone)."""
    pid = os.getpid()
    if pid in _threads:
        return
    with _lock:
        if pid in _threads:
            return
        thread = Heartbeat(store, worker_grace(app))
        thread.beat()  # when the database does not answer, the thread keeps trying (start_run beats too)
        thread.start()
        _threads[pid] = thread


def stop_heartbeat() -> None:
    """Stop this process's heartbeat thread (tests; a process's exit stops it anyway)."""
    thread = _threads.pop(os.getpid(), None)
    if thread is not None:
        thread.stopped.set()


__all__ = ["DEFAULT_GRACE", "Heartbeat", "RETRY_PAUSE", "defer", "host_name", "min_grace", "process_id",
           "renew_identity", "start_heartbeat", "stop_heartbeat", "worker_grace"]
