"""The client-side bound on every database call: a watchdog that cuts a connection that stopped answering.

A server-side ``statement_timeout`` answers a slow statement, and TCP keepalives
or ``tcp_user_timeout`` notice a peer whose packets are lost; neither helps when
the path to the database accepts bytes and never answers (a proxy or a
firewall that holds the connection: a black hole). No driver we support has a
per-call deadline for that case (libpq and psycopg wait for a reply for ever,
PyMySQL only per read), so each call of the store gets one here: :class:`Call`
is armed when the call starts, told which DBAPI connection it is on (the pool's
connect and checkout events do that, so the pre-ping and the session set-up
are covered too) and lets go of it in the pool's check-in event (after the
connection's reset, before another thread can check it out). When the deadline
passes before then, one watchdog thread shuts the connection's socket down. The driver then fails the
blocked read at once, SQLAlchemy invalidates the connection, and the store
raises :class:`~.errors.StoreUnavailable`: the caller's own back-off or
``ledger_wait`` holds, and one WARNING says which server stopped answering.

The socket is reached through a duplicate of its descriptor taken when the
call starts watching it, so a cut can never hit another socket that reused a
closed descriptor's number. Shutting a socket down is all the watchdog does; it
never closes a descriptor it does not own and never touches the driver.
"""
from __future__ import annotations

import heapq
import itertools
import logging
import os
import socket
import threading
import time
from typing import Any

logger = logging.getLogger("celery_cluster_beat.store.claims")

#: Seconds a database call may take, connection and pre-ping included, when no
#: ``cluster_beat_db_timeout`` is given (the setting's default, :mod:`..config.settings`).
DEFAULT_DB_TIMEOUT = 15.0


def socket_fileno(dbapi_conn: Any) -> int | None:
    """The descriptor of *dbapi_conn*'s socket, or None when the driver does not show it.

    psycopg (3 and 2) and mysqlclient have ``fileno()``; PyMySQL keeps its socket in
    ``_sock``, read only when it is a socket (otherwise the driver's own read timeout is
    the only bound). SQLite has no socket: nothing to cut, its busy timeout bounds it.
    """
    fileno = getattr(dbapi_conn, "fileno", None)
    if callable(fileno):
        try:
            fd = fileno()
        except Exception:  # closed, or not a socket-backed connection
            return None
        return fd if isinstance(fd, int) and fd >= 0 else None
    sock = getattr(dbapi_conn, "_sock", None)
    if isinstance(sock, socket.socket):
        fd = sock.fileno()
        return fd if fd >= 0 else None
    return None


class Call:
    """One store call's deadline and the socket it is cut through (see the module docstring)."""

    __slots__ = ("deadline", "seconds", "where", "_lock", "_fd", "_expired", "_done", "cut")

    def __init__(self, seconds: float, where: str) -> None:
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.where = where
        self._lock = threading.Lock()
        self._fd: int | None = None  # our duplicate of the watched socket's descriptor
        self._expired = False
        self._done = False
        #: The call overran its deadline and its connection was cut (the caller reports that).
        self.cut = False

    def watch(self, dbapi_conn: Any) -> None:
        """From now on the call runs on *dbapi_conn*: cut that one when the deadline passes."""
        fd = socket_fileno(dbapi_conn)
        if fd is None:
            return
        try:
            dup = os.dup(fd)
        except OSError:
            return
        with self._lock:
            if self._done:
                os.close(dup)
                return
            old, self._fd = self._fd, dup
            if self._expired:  # already overdue (say, a reconnect after the deadline): fail it now
                self._cut_locked()
        if old is not None:
            os.close(old)

    def expire(self) -> None:
        """The deadline passed (the watchdog calls this): cut the watched socket unless the call ended."""
        with self._lock:
            if self._done or self._expired:
                return
            self._expired = True
            self._cut_locked()

    def release(self) -> None:
        """The call's connection goes back to the pool (the check-in event calls this, before the
        pool can hand it out): stop watching it. Under the lock, so a cut already under way
        ends first and none starts after; a later :meth:`watch` arms the call again."""
        with self._lock:
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def finish(self) -> None:
        """The call ended: disarm, and let go of the duplicate descriptor."""
        with self._lock:
            self._done = True
            fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    @property
    def done(self) -> bool:
        return self._done

    def overdue(self) -> bool:
        """Whether the deadline has passed (the call failed late: the driver's own limit hit)."""
        return self._expired or time.monotonic() >= self.deadline

    def _cut_locked(self) -> None:
        fd = self._fd
        if fd is None or self.cut:
            return
        self.cut = True
        logger.warning("claim store %s: no answer within %gs (cluster_beat_db_timeout); cutting the "
                       "connection off, the call fails as unavailable", self.where, self.seconds)
        try:
            sock = socket.socket(fileno=fd)
        except OSError:
            return
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # already gone: the driver has noticed by itself
            pass
        finally:
            sock.detach()  # the descriptor stays ours until release() or finish()


class Watchdog:
    """One thread per process expiring the calls whose deadline passed (started on first use,
    again in a forked child, where the parent's thread does not exist)."""

    def __init__(self) -> None:
        self._seq = itertools.count()
        self._reset()
        # A child forked while the parent's thread held the condition would wait on it for ever.
        os.register_at_fork(after_in_child=self._reset)

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, Call]] = []
        self._pid: int | None = None

    def arm(self, call: Call) -> None:
        with self._cond:
            if self._pid != os.getpid():
                self._heap = []
                self._pid = os.getpid()
                threading.Thread(target=self._loop, name="cluster-beat-db-deadline", daemon=True).start()
            heapq.heappush(self._heap, (call.deadline, next(self._seq), call))
            if self._heap[0][2] is call:
                self._cond.notify()

    def _loop(self) -> None:
        pid = os.getpid()
        while True:
            due: list[Call] = []
            cond = self._cond
            with cond:
                if self._pid != pid or cond is not self._cond:  # pragma: no cover - reset after a fork
                    return
                heap = self._heap
                while heap and heap[0][2].done:
                    heapq.heappop(heap)
                now = time.monotonic()
                while heap and heap[0][0] <= now:
                    due.append(heapq.heappop(heap)[2])
                if not due:
                    # At most 20 wake-ups a second however many calls end unexpired: 50 ms is
                    # nothing against a bound of seconds.
                    cond.wait(max(0.05, heap[0][0] - now) if heap else None)
                    continue
            for call in due:
                try:
                    call.expire()
                except Exception:  # never let one call stop the watchdog
                    logger.exception("claim store: the call deadline watchdog failed")


#: The process's one watchdog.
WATCHDOG = Watchdog()
