"""This worker process's identity and heartbeat: what tells other workers its runs are alive.

A run row names the process that runs its body (``host:pid:random``: the random part
tells a pid reused after a restart from the one before). That process refreshes its row in
``cluster_beat_workers`` from a daemon thread of its own, started when the process first
opens the ledger store (so after the prefork pool forks: each pool child heartbeats for
itself, and a child that dies stops heartbeating with it). Every ``grace / 4`` seconds it
says "alive for ``grace`` more seconds" by the database's clock, so a run is taken over only
once its process missed about four heartbeats, or its worker's main process recorded it gone
(:mod:`.outcomes`). ``grace`` is the app's ``cluster_beat_worker_grace`` (default 30 s).

A process that cannot reach the database keeps trying and logs once per outage; past
``grace`` its runs may be taken over by a redelivery (as a beat node's claims are when its
heartbeat stops), so keep ``grace`` well above the database's usual hiccups.
"""
from __future__ import annotations

import logging
import os
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional

from ..base import MAX_NODE_ID_LENGTH
from ..errors import ConfigError
from ..store import ClaimStore, StoreUnavailable
from ..store.dialects.base import new_token

logger = logging.getLogger("celery_cluster_beat.worker")

#: Seconds a worker process counts as alive after its last heartbeat, unless the app's
#: ``cluster_beat_worker_grace`` says otherwise.
DEFAULT_GRACE = 30.0
#: Heartbeats per grace.
BEATS_PER_GRACE = 4
#: How often the heartbeat thread deletes rows of processes long gone (seconds).
PRUNE_EVERY = 3600.0

_identities: Dict[int, str] = {}
#: Writes that failed in a task (a finish the database did not take): the heartbeat thread
#: retries them until they go through, so a run whose end was not recorded does not read
#: as running for as long as this process lives.
_deferred: List[Callable[[], Any]] = []
_threads: Dict[int, "Heartbeat"] = {}
_lock = threading.Lock()


def worker_grace(app: Any) -> float:
    """The app's ``cluster_beat_worker_grace`` in seconds (a clear error when it is not a positive number)."""
    raw = app.conf.get("cluster_beat_worker_grace")
    if raw is None:
        return DEFAULT_GRACE
    try:
        value = float(raw)
    except (TypeError, ValueError):
        value = float("nan")
    if not (0 < value < 86400 * 365):  # also refuses nan and inf
        raise ConfigError(f"setting cluster_beat_worker_grace: expected a positive number of seconds, got {raw!r}")
    return value


def host_name() -> str:
    """This host's name as the heartbeat rows and a worker's main process know it."""
    return socket.gethostname()


def process_id() -> str:
    """This process's id for run rows and heartbeats: ``host:pid:random`` within the column width
    (the host part is cut, never the pid or the random part)."""
    pid = os.getpid()
    ident = _identities.get(pid)
    if ident is None:
        tail = f":{pid}:{new_token()[:8]}"
        ident = host_name()[: MAX_NODE_ID_LENGTH - len(tail)] + tail
        _identities[pid] = ident
    return ident


class Heartbeat(threading.Thread):
    """The daemon thread that keeps this process's heartbeat row fresh."""

    def __init__(self, store: ClaimStore, grace: float) -> None:
        super().__init__(name="cluster-beat-heartbeat", daemon=True)
        self.store = store
        self.grace = grace
        self.process = process_id()
        self.pid = os.getpid()
        self.stopped = threading.Event()
        self._failing = False
        self._pruned_at: Optional[float] = None

    def beat(self) -> bool:
        """One heartbeat; False when this process was recorded gone (it then stops)."""
        try:
            alive = self.store.worker_heartbeat(self.process, host=host_name(), pid=self.pid, grace=self.grace)
        except StoreUnavailable as exc:
            if not self._failing:
                logger.warning("cluster-beat ledger: worker process %s cannot heartbeat (%s); past %gs its "
                               "runs may be taken over", self.process, exc, self.grace)
            self._failing = True
            return True
        if self._failing:
            logger.info("cluster-beat ledger: worker process %s heartbeats again", self.process)
            self._failing = False
        if not alive:
            logger.error("cluster-beat ledger: worker process %s was recorded gone; it stops heartbeating",
                         self.process)
            return False
        while _deferred:
            try:
                _deferred[0]()
            except StoreUnavailable:
                break
            except Exception:  # pragma: no cover  (a bug must not stop the heartbeat)
                logger.exception("cluster-beat ledger: a deferred ledger write failed")
            _deferred.pop(0)
        if self._pruned_at is None or time.monotonic() - self._pruned_at > PRUNE_EVERY:
            self._pruned_at = time.monotonic()
            try:
                self.store.prune_workers()
            except StoreUnavailable:
                pass
        return True

    def run(self) -> None:
        interval = self.grace / BEATS_PER_GRACE
        while not self.stopped.wait(interval):
            if not self.beat():
                return


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
        if not thread.beat():  # pragma: no cover  (a fresh identity is never recorded gone)
            return
        thread.start()
        _threads[pid] = thread


def stop_heartbeat() -> None:
    """Stop this process's heartbeat thread (tests; a process's exit stops it anyway)."""
    thread = _threads.pop(os.getpid(), None)
    if thread is not None:
        thread.stopped.set()


__all__ = ["DEFAULT_GRACE", "Heartbeat", "defer", "host_name", "process_id", "start_heartbeat", "stop_heartbeat",
           "worker_grace"]
