"""What the dashboard reads, through a store and a Redis client of its own (beat's process).

Apart from the server (:mod:`.http`): the reads are :mod:`.report`'s and :mod:`.schedulepage`'s,
all bounded (the first schedules by relevance, at most 500; one schedule's last occurrences with
``LIMIT``; failures of the last hour counted up to a cap), each run on one of the HTTP server's
pool threads, never on the scheduling loop's.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Dict, Optional, Tuple

from ..leader.urls import mask_url

logger = logging.getLogger("celery_cluster_beat")

__all__ = ["ReportSource", "PAUSED_SHOWN", "STORED_COUNT_EVERY"]

#: The page names at most this many paused schedules (all are counted).
PAUSED_SHOWN = 20
#: ``cluster_beat_stored_schedules`` is read from the claim store at most this often (seconds).
STORED_COUNT_EVERY = 30.0


class ReportSource:
    """What ``status`` prints and the first schedules by relevance (:mod:`.schedulepage`), read through
    a store and a Redis client of the page's own (opened on the first request, kept until
    :meth:`close`): the page's reads never queue behind the scheduler's connections, nor count in
    its claim-store metrics. The config's entries are validated once and kept, with their next fires."""

    def __init__(self, app: Any, settings: Any) -> None:
        self.app, self.settings = app, settings
        self._store: Any = None
        self._redis: Any = None
        self._lock = threading.Lock()
        self._entries: Any = None
        self._fires: Any = None
        self._stored: Tuple[float, float] = (float("-inf"), float("nan"))  # (monotonic time read, count)

    def _open(self) -> Any:
        from . import report

        if self._store is None:
            self._store = report.open_store(self.app, self.settings)
        return self._store

    def _prepare(self) -> Any:
        from . import report, schedulepage

        store = self._open()
        if self._redis is None and self.settings.redis is not None:
            self._redis = self.settings.redis.client()
        if self._entries is None:
            self._entries, self._fires = report.config_entries(self.app), schedulepage.NextFires()
        return store

    def read(self, limit: Optional[int] = None, query: Optional[str] = None, state: Optional[str] = None,
             sort: Optional[str] = None) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """(the status, the page of schedules) as JSON-safe dicts; the status carries
        ``failed_last_hour`` (failed occurrences of the last hour, None when it could not be counted)."""
        from . import report, schedulepage
        from .dashboard import FAILURE_WINDOW

        with self._lock:
            store = self._prepare()
            status = report.cluster_status(self.app, store, self._redis, settings=self.settings,
                                           paused_limit=PAUSED_SHOWN)
            view = schedulepage.schedule_page(self.app, store, limit=limit, query=query, settings=self.settings,
                                              entries=self._entries, fires=self._fires, state=state, sort=sort)
            try:
                failures: Optional[int] = store.failures_since(FAILURE_WINDOW)
            except Exception as exc:  # the page still shows what it read
                logger.debug("cluster-beat http: counting failures failed: %s", mask_url(repr(exc)))
                failures = None
            self._stored = (time.monotonic(), float(status.stored_schedules))
        out = status.as_dict()
        out["failed_last_hour"] = failures
        return out, view.as_dict()

    def detail(self, name: str) -> Any:
        """Schedule *name*'s :class:`~.schedulepage.ScheduleDetail` (None: no such schedule)."""
        from . import schedulepage

        with self._lock:
            store = self._prepare()
            return schedulepage.schedule_detail(self.app, store, name, settings=self.settings, entries=self._entries)

    def stored_count(self) -> float:
        """Live stored schedules, read at most every :data:`STORED_COUNT_EVERY` seconds (NaN until read)."""
        read_at, count = self._stored
        if time.monotonic() - read_at < STORED_COUNT_EVERY or not self._lock.acquire(blocking=False):
            return count  # fresh, or a page build holds the store (it reads the count too)
        try:
            self._stored = (time.monotonic(), count)  # failed or not, not again before the period ends
            count = float(self._open().stored_count())
            self._stored = (time.monotonic(), count)
        except Exception as exc:  # the database is down: /metrics still answers
            logger.debug("cluster-beat http: counting stored schedules failed: %s", mask_url(repr(exc)))
        finally:
            self._lock.release()
        return count

    def close(self) -> None:
        with self._lock:
            store, self._store = self._store, None
            client, self._redis = self._redis, None
        for thing in (store, client):
            if thing is not None:
                try:
                    thing.close()
                except Exception:  # never fail a shutdown
                    logger.debug("cluster-beat http: closing %r failed", thing, exc_info=True)
