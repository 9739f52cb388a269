"""A small read-only HTTP server inside beat: ``/metrics``, ``/healthz`` and a status page.

Started by beat when ``cluster_beat_http_port`` is set (bound to
``cluster_beat_http_host``, 127.0.0.1 unless it says otherwise; port 0 picks a
free port, which beat logs). It runs on threads of its own with fixed bounds
(:mod:`.httpserver`: a selector thread, a small worker pool, a connection cap and
read, idle and write deadlines), so a request never waits for the scheduling loop
and no client, however many or slow, can take the loop's process from it.

* ``/metrics``: the Prometheus text format of this beat's own registry (:mod:`.metrics`,
  bounded whatever the schedule count), built at most once a second: scrapers in between share it.
* ``/healthz``: 200 while the loop ticked within the sleep it asked for plus a margin,
  503 otherwise (for a Kubernetes liveness probe): a loop stuck in a call, or never
  coming back from one, stops ticking while this thread still answers. Answered on
  the selector thread itself: never queued behind a page being built.
* ``/``: an HTML page (:mod:`.pagehtml`) with what ``celery ... cluster-beat status`` shows and
  the first schedules by relevance (:mod:`.schedulepage`: ``?limit=`` up to 500, ``?q=`` a part
  of the name), built at most once every 2 s however many clients ask (they share the build).
  One view is built at a time: a request for another view that has no recent copy and cannot be
  built now is answered ``503`` with ``Retry-After`` at once (it never holds one of the pool's
  threads waiting), and the default view (no filter, the default limit) is never pushed out of the
  cache. When both the default view and others are asked for, the build slot alternates between
  them: clients cycling through filters cannot starve the default view, nor can a dashboard
  reloading the default view starve someone's filter.
  Read-only: GET and HEAD only, no forms, no scripts, every value escaped, a strict
  Content-Security-Policy. The URLs on it are masked where they are read (no
  passwords); names and descriptions are shown as they are, escaped.

``cluster_beat_http_page=False`` serves ``/healthz`` alone (the page and ``/metrics``
answer 404); ``cluster_beat_http_token`` makes the page and ``/metrics`` require
``Authorization: Bearer <token>`` (401 without it; ``/healthz`` never needs it).
"""
from __future__ import annotations

import hmac
import logging
import math
import threading
import time
from collections import OrderedDict
from datetime import datetime
from typing import Any, Callable, Dict, Iterable, Optional, Tuple
from urllib.parse import parse_qs

from ..errors import ConfigError
from ..leader.urls import mask_url
from .httpserver import BoundedHTTPServer, Limits, Request, Response
from .pagehtml import PAGE_REFRESH, render_error, render_page  # noqa: F401  (importable from here as before)

logger = logging.getLogger("celery_cluster_beat")

__all__ = ["LoopHealth", "OpsServer", "BeatOps", "start_beat_server", "render_page"]

#: /healthz tolerates this much beyond the sleep the loop asked for, at least (seconds).
MIN_HEALTH_MARGIN = 5.0
#: The status page is rebuilt at most this often (seconds), whatever clients ask: it reads the
#: database and Redis on a thread of beat's process, so clients share one build per period.
PAGE_CACHE = 2.0
#: A page younger than this is served while the next build must wait.
PAGE_STALE = 30.0
#: Longest a request for the default view waits for its build (then 503, ``Retry-After``): a build
#: that hangs (a database call in the black hole until its bound) must not hold the pool's threads.
PAGE_WAIT = 20.0
#: Pages of this many filters and limits are kept (the default view's always among them).
PAGE_KEYS = 8
#: ``/metrics`` is built at most this often (seconds); scrapers in between share the last one.
METRICS_CACHE = 1.0


class LoopHealth:
    """What ``/healthz`` knows: when the loop last ticked and how long it then meant to sleep.

    The scheduler calls :meth:`ticked` at the end of every tick; nothing else of the
    scheduler is visible to the HTTP thread.
    """

    def __init__(self, margin: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.margin = float(margin)
        self._clock = clock
        self._last = clock()  # start-up counts as a tick: the first real one comes within the margin
        self._sleep = 0.0
        self.ticks = 0
        #: Set by beat when the loop ticks but cannot do its work (every send fails); None: fine.
        self.problem: Optional[str] = None

    def ticked(self, sleep: float) -> None:
        self._sleep = max(0.0, float(sleep))
        self._last = self._clock()
        self.ticks += 1

    def age(self) -> float:
        """Seconds since the last tick ended."""
        return max(0.0, self._clock() - self._last)

    def check(self) -> Tuple[bool, str]:
        age, allowed = self.age(), self._sleep + self.margin
        ok = age <= allowed
        text = (f"{'ok' if ok else 'stalled'}: last tick {age:.1f} s ago, "
                f"allowed {allowed:.1f} s (sleep {self._sleep:.1f} s + margin {self.margin:.1f} s)")
        problem = self.problem
        if problem is not None:
            return False, f"failing: {problem}; {text}"
        return ok, text


_SECURITY_HEADERS = {
    "Cache-Control": "no-store",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; form-action 'none'; "
                               "frame-ancestors 'none'",
}
_TEXT = "text/plain; charset=utf-8"
#: The status page's paths: they and /metrics need the token when one is set, /healthz never (a probe has no secret).
PAGE_PATHS = ("/", "/index.html")


#: The page's view when the URL asks for nothing: (limit, filter).
DEFAULT_VIEW: Tuple[int, Optional[str]] = (100, None)


def page_view(query: str) -> Tuple[int, Optional[str]]:
    """(limit, filter) from the URL's query string: ``limit`` (capped) and ``q`` (see
    :func:`.schedulepage.page_params`); other parameters are ignored. ValueError when bad."""
    if not query:
        return DEFAULT_VIEW
    from .schedulepage import page_params

    try:
        fields = parse_qs(query, keep_blank_values=True, max_num_fields=16)
    except ValueError:
        raise ValueError("too many parameters") from None
    return page_params((fields.get("limit") or [None])[-1], (fields.get("q") or [None])[-1])


class OpsServer:
    """The HTTP server; *metrics* (``ClusterBeatMetrics``), *health* (:class:`LoopHealth`) and
    *page* (returns the status page's HTML: ``page()`` for the default view, ``page(limit=...,
    query=...)`` for another) are each optional: a missing one answers 404.
    With *token*, the page and ``/metrics`` need ``Authorization: Bearer <token>``."""

    def __init__(self, host: str, port: int, *, metrics: Any = None, health: Optional[LoopHealth] = None,
                 page: Optional[Callable[[], str]] = None, token: Optional[str] = None,
                 limits: Optional[Limits] = None) -> None:
        self.host, self.port = host, port
        self.metrics, self.health, self.page = metrics, health, page
        self._token = token.encode() if token else None
        self.limits = limits or Limits()
        self._server: Optional[BoundedHTTPServer] = None
        self._page_cond = threading.Condition()
        #: (limit, query) -> (monotonic time built, status, body); the most recently used last.
        self._page_cache: "OrderedDict[Tuple[int, Optional[str]], Tuple[float, int, bytes]]" = OrderedDict()
        self._page_building = False
        self._page_next = float("-inf")  # monotonic time before which no page build starts
        #: When a request for the default view last found no fresh copy and could not build one, and
        #: when a request for another view was last turned away: who the next free slot is for.
        self._default_wanted = float("-inf")
        self._other_wanted = float("-inf")
        self._last_built: Optional[Tuple[int, Optional[str]]] = None
        self.page_builds = 0
        self.page_busy = 0  # requests answered 503 "busy" (another view's build holds the slot)
        self._metrics_lock = threading.Lock()
        self._metrics_cache: Tuple[float, bytes] = (float("-inf"), b"")

    @property
    def url(self) -> str:
        host = self.host if ":" not in self.host else f"[{self.host}]"
        return f"http://{host}:{self.port}/"

    def start(self) -> "OpsServer":
        server = BoundedHTTPServer(self.host, self.port, self.handle, inline=self._is_health, limits=self.limits)
        self._server = server.start()
        self.port = server.port
        return self

    def stop(self) -> None:
        server, self._server = self._server, None
        if server is not None:
            server.stop()

    def open_connections(self) -> int:
        return self._server.open_connections() if self._server is not None else 0

    def _is_health(self, req: Request) -> bool:
        return req.path == "/healthz"

    def handle(self, req: Request) -> Response:
        """One request: read-only methods, the token where it is needed, then :meth:`route`."""
        if req.method not in ("GET", "HEAD"):
            return self._response(405, b"read-only: GET and HEAD only\n", _TEXT, Allow="GET, HEAD")
        path = req.path
        if self._token is not None and self._guarded(path) and not self._authorised(req):
            return self._response(401, b"a bearer token is required\n", _TEXT,
                                  **{"WWW-Authenticate": 'Bearer realm="cluster-beat"'})
        status, body, ctype, *extra = self.route(path, req.target.partition("?")[2])
        return self._response(status, body, ctype, **(extra[0] if extra else {}))

    def _guarded(self, path: str) -> bool:
        """Whether *path* is served and needs the token (what is not served is a 404 for anyone)."""
        return (path == "/metrics" and self.metrics is not None) or (path in PAGE_PATHS and self.page is not None)

    def _authorised(self, req: Request) -> bool:
        scheme, _, given = req.headers.get("authorization", "").partition(" ")
        # compare_digest: the time taken does not tell how much of the token was right
        return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode("latin-1"), self._token or b"")

    @staticmethod
    def _response(status: int, body: bytes, ctype: str, **extra: str) -> Response:
        return Response(status, body, ctype, headers={**_SECURITY_HEADERS, **extra})

    def route(self, path: str, query: str = "") -> Tuple[Any, ...]:
        """(status, body, content type[, extra headers]) of a GET of *path* with *query*."""
        if path == "/metrics" and self.metrics is not None:
            from .metrics import CONTENT_TYPE

            return 200, self._exposition(), CONTENT_TYPE
        if path == "/healthz" and self.health is not None:
            ok, text = self.health.check()
            return (200 if ok else 503), (text + "\n").encode(), _TEXT
        if path in PAGE_PATHS and self.page is not None:
            try:
                view = page_view(query)
            except ValueError as exc:
                return 400, f"bad query: {exc}\n".encode(), _TEXT
            return self._page(view)
        served = [p for p, on in (("/metrics", self.metrics), ("/healthz", self.health), ("/", self.page))
                  if on is not None]
        return 404, f"not found: {', '.join(served) or 'nothing is served'}\n".encode(), _TEXT

    def _exposition(self) -> bytes:
        with self._metrics_lock:  # one build at a time; scrapers meanwhile wait for it and share it
            built, body = self._metrics_cache
            if time.monotonic() - built >= METRICS_CACHE:
                body = self.metrics.exposition()
                self._metrics_cache = (time.monotonic(), body)
            return body

    def _page(self, view: Tuple[int, Optional[str]]) -> Tuple[Any, ...]:
        """The page of *view* (limit, filter), as :meth:`route` answers it.

        A fresh one from the cache; else one build at a time and at most one every :data:`PAGE_CACHE`
        seconds (at least as long as the last build took, so builds take half of one thread at
        most). When the slot is not free: the last page of the view if younger than
        :data:`PAGE_STALE`; else the default view waits for the slot (its requests share one build),
        and any other view is answered 503 with ``Retry-After`` at once. When the default view and
        others both want the slot, it alternates between them (:meth:`_turn`), whichever view finds
        it free."""
        default = view == DEFAULT_VIEW
        cond = self._page_cond
        started = time.monotonic()
        with cond:
            while True:
                now = time.monotonic()
                cached = self._page_cache.get(view)
                if cached is not None and now - cached[0] < PAGE_CACHE:
                    return self._html(cached)
                if not self._page_building and now >= self._page_next:
                    build = self._turn(view, now)
                    if build is not None:
                        break
                if default:
                    self._default_wanted = now
                else:
                    self._other_wanted = now
                if cached is not None and now - cached[0] < PAGE_STALE:
                    return self._html(cached)
                if not default:
                    return self._busy(now)
                if now - started > PAGE_WAIT:  # a build that hangs holds no pool thread for long
                    return self._busy(now)
                cond.wait(timeout=max(0.01, min(self._page_next - now, PAGE_WAIT)) if not self._page_building
                          else PAGE_WAIT)
            self._page_building = True
        built = self._build(build)
        if build == view:
            return self._html((0.0, *built))
        with cond:  # this request's slot went to the default view: its own view's turn comes later
            now = time.monotonic()
            cached = self._page_cache.get(view)
            return self._html(cached) if cached is not None and now - cached[0] < PAGE_STALE else self._busy(now)

    def _turn(self, view: Tuple[int, Optional[str]], now: float) -> Optional[Tuple[int, Optional[str]]]:
        """Which view a request for *view* that found the slot free builds: its own; or, when the
        default view's turn has come (it was wanted lately, its copy is not fresh and the last build
        was another view's), the default view's; None to leave the slot to the other views (the last
        build was the default view's, one was turned away lately, and the default view's copy is
        recent enough to serve)."""
        cached = self._page_cache.get(DEFAULT_VIEW)
        if view == DEFAULT_VIEW:
            yields = (self._last_built == DEFAULT_VIEW and now - self._other_wanted < 2 * PAGE_CACHE + 1
                      and cached is not None and now - cached[0] < PAGE_STALE)
            return None if yields else view
        due = (now - self._default_wanted < PAGE_STALE and self._last_built != DEFAULT_VIEW
               and (cached is None or now - cached[0] >= PAGE_CACHE))
        return DEFAULT_VIEW if due else view

    @staticmethod
    def _html(cached: Tuple[float, int, bytes]) -> Tuple[int, bytes, str]:
        return cached[1], cached[2], "text/html; charset=utf-8"

    def _busy(self, now: float) -> Tuple[int, bytes, str, Dict[str, str]]:
        """503 for a view that can be neither served nor built now, with when to try again."""
        self.page_busy += 1
        wait = max(1, math.ceil(max(self._page_next - now, PAGE_CACHE if self._page_building else 0.0)))
        return (503, f"busy: the status page builds one view at a time; try again in {wait} s\n".encode(), _TEXT,
                {"Retry-After": str(wait)})

    def _build(self, view: Tuple[int, Optional[str]]) -> Tuple[int, bytes]:
        """Build *view*'s page (the slot is this thread's) and cache it; frees the slot."""
        cond = self._page_cond
        started = time.monotonic()
        built: Optional[Tuple[int, bytes]] = None
        try:
            try:  # the default view calls page() without arguments: a page that takes none still serves it
                args = {} if view == DEFAULT_VIEW else {"limit": view[0], "query": view[1]}
                built = 200, self.page(**args).encode()
            except Exception as exc:
                logger.warning("cluster-beat http: building the status page failed: %s", mask_url(repr(exc)))
                built = 503, render_error(exc).encode()
        finally:
            with cond:
                ended = time.monotonic()
                self.page_builds += 1
                self._page_building = False
                self._page_next = max(started + PAGE_CACHE, ended + (ended - started))
                self._last_built = view
                if view == DEFAULT_VIEW:
                    self._default_wanted = float("-inf")
                if built is not None:
                    self._page_cache[view] = (ended, *built)
                    self._page_cache.move_to_end(view)
                    while len(self._page_cache) > PAGE_KEYS:  # the least recently built, never the default view
                        oldest = next(k for k in self._page_cache if k != DEFAULT_VIEW)
                        del self._page_cache[oldest]
                cond.notify_all()
        return built


# ----------------------------------------------------------------------------- beat's glue


class BeatOps:
    """What beat holds while the server runs: the health it updates each tick, and ``stop()``."""

    def __init__(self, server: OpsServer, health: LoopHealth, metrics: Any, store: Any,
                 source: Optional["_ReportSource"] = None) -> None:
        self.server, self.health, self.metrics, self._store, self._source = server, health, metrics, store, source

    @property
    def url(self) -> str:
        return self.server.url

    def attach(self, *, lease: Any = None, also_from: Iterable[Any] = (), config: Iterable[str] = ()) -> None:
        """Beat's set-up finished (the store answered): time *lease*'s renewals (or, without a lease,
        say this node schedules), count the signals of *also_from* (the overlap guard), and give the
        config's entries (*config*) series of their own in the metrics."""
        for sender in also_from:
            self.metrics.also_count(sender)
        self.metrics.set_config(frozenset(config))
        if lease is not None:
            self.metrics.instrument_lease(lease)
        else:
            self.metrics.set_leader(True)  # without a lease every replica schedules (and races on claims)

    def stop(self) -> None:
        try:
            self.server.stop()
        finally:
            self.metrics.close()
            if self._source is not None:
                self._source.close()
            if self._store is not None and getattr(self._store, "observer", None) == self.metrics.store_observer:
                self._store.observer = None


def start_beat_server(app: Any, settings: Any, *, sender: Any, store: Any = None,
                      now: Optional[Callable[[], datetime]] = None) -> BeatOps:
    """Build the metrics, hook them to *store* (open or not yet) and start the server. Beat calls
    this in ``setup_schedule`` when ``cluster_beat_http_port`` is set, before it waits for the
    database, so ``/healthz`` answers while it does; then :meth:`BeatOps.attach` once set up."""
    from .metrics import ClusterBeatMetrics

    kwargs = {"now": now} if now is not None else {}
    metrics = ClusterBeatMetrics(node=settings.node_id, cluster=settings.cluster_name,
                                 per_schedule=settings.metrics_per_schedule, stored_max=settings.metrics_stored_max,
                                 sender=sender, **kwargs).connect()
    if store is not None:
        store.observer = metrics.store_observer
    health = LoopHealth(margin=max(MIN_HEALTH_MARGIN, settings.lock_ttl))
    from prometheus_client import Gauge

    Gauge("cluster_beat_tick_age_seconds", "Seconds since the scheduling loop last ticked",
          registry=metrics.registry).set_function(health.age)

    source = _ReportSource(app, settings)
    Gauge("cluster_beat_stored_schedules", "Live stored schedules (read from the claim store at most every 30 s)",
          registry=metrics.registry).set_function(source.stored_count)

    def page(limit: Optional[int] = None, query: Optional[str] = None) -> str:
        status, view = source.read(limit, query)
        schedules = view.pop("schedules")
        return render_page(title=f"cluster-beat: {settings.cluster_name}", node=settings.node_id,
                           status=status, schedules=schedules, health=health.check()[1], shown=view)

    shown = settings.http_page  # False: /healthz alone
    server = OpsServer(settings.http_host, settings.http_port, metrics=metrics if shown else None, health=health,
                       page=page if shown else None, token=settings.http_token)
    try:
        server.start()
    except OSError as exc:
        metrics.close()
        source.close()
        if store is not None:
            store.observer = None
        raise ConfigError([f"setting cluster_beat_http_port: cannot listen on {settings.http_host}:"
                           f"{settings.http_port}: {exc}"]) from exc
    logger.info("cluster-beat: %s on %s%s%s", "status page, /metrics and /healthz" if shown else "/healthz alone",
                server.url, " (port picked by the system)" if not settings.http_port else "",
                " (the page and /metrics need the bearer token)" if shown and settings.http_token else "")
    return BeatOps(server, health, metrics, store, source)


#: The page names at most this many paused schedules (all are counted).
PAUSED_SHOWN = 20
#: ``cluster_beat_stored_schedules`` is read from the claim store at most this often (seconds).
STORED_COUNT_EVERY = 30.0


class _ReportSource:
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

    def read(self, limit: Optional[int] = None, query: Optional[str] = None) -> Tuple[Dict[str, Any], Dict[str, Any]]:
        """(the status, the page of schedules) as JSON-safe dicts."""
        from . import report, schedulepage

        with self._lock:
            store = self._open()
            if self._redis is None and self.settings.redis is not None:
                self._redis = self.settings.redis.client()
            if self._entries is None:
                self._entries, self._fires = report.config_entries(self.app), schedulepage.NextFires()
            status = report.cluster_status(self.app, store, self._redis, settings=self.settings,
                                           paused_limit=PAUSED_SHOWN)
            view = schedulepage.schedule_page(self.app, store, limit=limit, query=query, settings=self.settings,
                                              entries=self._entries, fires=self._fires)
            self._stored = (time.monotonic(), float(status.stored_schedules))
        return status.as_dict(), view.as_dict()

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
