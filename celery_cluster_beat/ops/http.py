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
* ``/``: the dashboard (:mod:`.pagehtml`, :mod:`.dashboard`): a health line (leader, lease,
  nodes, late and failed occurrences, the loop), the first schedules by relevance
  (:mod:`.schedulepage`: ``?limit=`` up to 500, ``?q=`` a part of the name, ``?state=`` failing,
  paused, overdue, running or ok, ``?sort=`` attention, name, next or last) and the nodes;
  ``/schedules/<name>`` (the name URL-quoted) one schedule: its next fires and its latest
  occurrences with their runs. Each view is built at most once every 2 s however many clients
  ask (they share the build).
  One view is built at a time: a request for another view that has no recent copy and cannot be
  built now is answered ``503`` with ``Retry-After`` at once (it never holds one of the pool's
  threads waiting), and the default view (no filter, the default limit) is never pushed out of the
  cache. When both the default view and others are asked for, the build slot alternates between
  them: clients cycling through filters cannot starve the default view, nor can a dashboard
  reloading the default view starve someone's filter.
  Read-only unless ``cluster_beat_http_actions_token`` is set (then run-now, pause and resume
  from a schedule's page: POST with that token, same origin only, :mod:`.dashboardactions`):
  no scripts, every value escaped, a strict Content-Security-Policy. The URLs on it are masked
  where they are read (no passwords); names and descriptions are shown as they are, escaped.

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

from ..errors import ConfigError
from ..leader.urls import mask_url
from .dashboardsource import ReportSource
from .dashboardviews import DEFAULT_VIEW, SCHEDULE_PREFIX, View, page_view, schedule_view  # noqa: F401
from .httpserver import BoundedHTTPServer, Limits, Request, Response
from .pagehtml import PAGE_REFRESH, render_error, render_message, render_page, render_schedule  # noqa: F401

logger = logging.getLogger("celery_cluster_beat")

__all__ = ["LoopHealth", "OpsServer", "BeatOps", "View", "start_beat_server", "render_page"]

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
    # same-origin: a form of the page posts with its Origin (no-referrer would make it "null"); no other site learns a URL
    "Referrer-Policy": "same-origin",
    # form-action 'self': the filter bar (a GET) and, when turned on, the actions post to this server only
    "Content-Security-Policy": "default-src 'none'; style-src 'unsafe-inline'; img-src 'self' data:; "
                               "form-action 'self'; frame-ancestors 'none'; base-uri 'none'",
}
_TEXT = "text/plain; charset=utf-8"
_HTML = "text/html; charset=utf-8"
#: The status page's paths: they and /metrics need the token when one is set, /healthz never (a probe has no secret).
PAGE_PATHS = ("/", "/index.html")
class OpsServer:
    """The HTTP server; *metrics* (``ClusterBeatMetrics``), *health* (:class:`LoopHealth`) and
    *page* (returns the status page's HTML: ``page()`` for the default view, ``page(limit=...,
    query=...[, state=..., sort=...])`` for another) are each optional: a missing one answers 404.
    *detail* returns one schedule's page (``detail(name)``, None: no such schedule: 404); *actions*
    (an :class:`~.dashboardactions.Actions`) carries out POSTs to a schedule's ``run``, ``pause`` and
    ``resume`` (None: every POST is 405).
    With *token*, the pages and ``/metrics`` need ``Authorization: Bearer <token>``."""

    def __init__(self, host: str, port: int, *, metrics: Any = None, health: Optional[LoopHealth] = None,
                 page: Optional[Callable[..., str]] = None, token: Optional[str] = None,
                 limits: Optional[Limits] = None, detail: Optional[Callable[[str], Optional[str]]] = None,
                 actions: Any = None, node: str = "") -> None:
        self.host, self.port = host, port
        self.metrics, self.health, self.page, self.detail, self.actions = metrics, health, page, detail, actions
        self.node = node
        self._token = token.encode() if token else None
        self.limits = limits or Limits()
        self._server: Optional[BoundedHTTPServer] = None
        self._page_cond = threading.Condition()
        #: view -> (monotonic time built, status, body); the most recently used last.
        self._page_cache: "OrderedDict[View, Tuple[float, int, bytes]]" = OrderedDict()
        self._page_building = False
        self._page_next = float("-inf")  # monotonic time before which no page build starts
        #: When a request for the default view last found no fresh copy and could not build one, and
        #: when a request for another view was last turned away: who the next free slot is for.
        self._default_wanted = float("-inf")
        self._other_wanted = float("-inf")
        self._last_built: Optional[View] = None
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
        """One request: GET and HEAD, POST to an action when actions are on; the token where it is
        needed; then :meth:`route` (or :meth:`act`)."""
        path = req.path
        try:
            name, verb = schedule_view(path)
        except UnicodeDecodeError:  # not UTF-8 once unquoted: route() answers 400 (no traceback, no action)
            name, verb = None, None
        posting = self.actions is not None and verb is not None and self.detail is not None
        allowed = "POST" if posting else "GET, HEAD"
        if req.method not in (("POST",) if posting else ("GET", "HEAD")):
            text = (b"actions need a POST\n" if posting else
                    b"read-only: GET and HEAD only\n" if self.actions is None else b"GET and HEAD only here\n")
            return self._response(405, text, _TEXT, Allow=allowed)
        if self._token is not None and self._guarded(path) and not self._authorised(req):
            return self._response(401, b"a bearer token is required\n", _TEXT,
                                  **{"WWW-Authenticate": 'Bearer realm="cluster-beat"'})
        if posting:
            return self.act(req, name or "", verb or "")
        status, body, ctype, *extra = self.route(path, req.target.partition("?")[2])
        return self._response(status, body, ctype, **(extra[0] if extra else {}))

    def act(self, req: Request, name: str, verb: str) -> Response:
        """A POST to a schedule's action: :class:`~.dashboardactions.Actions` decides and acts; the
        answer is a short page saying what happened, which goes back to the schedule's page."""
        from .dashboard import schedule_href

        status, text, tone = self.actions.handle(verb, name, req.headers, req.body)
        back = schedule_href(name) if name else "/"
        if status == 200:
            with self._page_cond:  # its page is rebuilt when next asked, not served from before the action
                for view in [v for v in self._page_cache if v.schedule == name]:
                    del self._page_cache[view]
        body = render_message(title="cluster-beat", node=self.node, text=text, tone=tone, back=back,
                              refresh=2 if status == 200 else None, goto=back if status == 200 else None)
        return self._response(status, body.encode(), _HTML)

    def _guarded(self, path: str) -> bool:
        """Whether *path* is served and needs the token (what is not served is a 404 for anyone)."""
        return ((path == "/metrics" and self.metrics is not None) or (path in PAGE_PATHS and self.page is not None)
                or (path.startswith(SCHEDULE_PREFIX) and self.detail is not None))

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
        if path.startswith(SCHEDULE_PREFIX) and self.detail is not None:
            try:
                name, verb = schedule_view(path)
            except UnicodeDecodeError:
                return 400, b"bad schedule name: not UTF-8\n", _TEXT
            from .schedulepage import QUERY_MAX

            if name is None or verb is not None or len(name) > QUERY_MAX or not name.isprintable():
                return 404, b"not found: /schedules/<name, URL-quoted>\n", _TEXT
            return self._page(View(0, schedule=name))
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

    def _page(self, view: View) -> Tuple[Any, ...]:
        """The page of *view*, as :meth:`route` answers it.

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

    def _turn(self, view: View, now: float) -> Optional[View]:
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
        return cached[1], cached[2], _HTML

    def _render(self, view: View) -> Tuple[int, bytes]:
        """(status, HTML) of *view*: the default view calls ``page()`` without arguments (a page that
        takes none still serves it), another passes only what differs from a plain filter."""
        if view.schedule is not None:
            html = self.detail(view.schedule)
            if html is None:
                return 404, render_message(title="cluster-beat", node=self.node, tone="bad", back="/",
                                           text=f"no schedule is named {view.schedule!r}").encode()
            return 200, html.encode()
        if view == DEFAULT_VIEW:
            return 200, self.page().encode()
        args: Dict[str, Any] = {"limit": view.limit, "query": view.query}
        args.update({k: v for k, v in (("state", view.state), ("sort", view.sort)) if v is not None})
        return 200, self.page(**args).encode()

    def _busy(self, now: float) -> Tuple[int, bytes, str, Dict[str, str]]:
        """503 for a view that can be neither served nor built now, with when to try again."""
        self.page_busy += 1
        wait = max(1, math.ceil(max(self._page_next - now, PAGE_CACHE if self._page_building else 0.0)))
        return (503, f"busy: the status page builds one view at a time; try again in {wait} s\n".encode(), _TEXT,
                {"Retry-After": str(wait), "Refresh": str(wait)})  # a browser asks again by itself

    def _build(self, view: View) -> Tuple[int, bytes]:
        """Build *view*'s page (the slot is this thread's) and cache it; frees the slot."""
        cond = self._page_cond
        started = time.monotonic()
        built: Optional[Tuple[int, bytes]] = None
        try:
            try:
                built = self._render(view)
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
                 source: Optional[ReportSource] = None) -> None:
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

    source = ReportSource(app, settings)
    Gauge("cluster_beat_stored_schedules", "Live stored schedules (read from the claim store at most every 30 s)",
          registry=metrics.registry).set_function(source.stored_count)
    title = f"cluster-beat: {settings.cluster_name}"
    actions = None
    actions_token = getattr(settings, "http_actions_token", None)
    if actions_token:
        from .dashboardactions import Actions

        actions = Actions(app, settings, actions_token)

    def page(limit: Optional[int] = None, query: Optional[str] = None, state: Optional[str] = None,
             sort: Optional[str] = None) -> str:
        status, view = source.read(limit, query, state, sort)
        schedules = view.pop("schedules")
        return render_page(title=title, node=settings.node_id, status=status, schedules=schedules,
                           health=health.check(), shown=view, failures=status.get("failed_last_hour"),
                           actions=actions is not None)

    def detail(name: str) -> Optional[str]:
        found = source.detail(name)
        if found is None:
            return None
        return render_schedule(title=title, node=settings.node_id, detail=found, actions=actions is not None)

    shown = settings.http_page  # False: /healthz alone
    server = OpsServer(settings.http_host, settings.http_port, metrics=metrics if shown else None, health=health,
                       page=page if shown else None, token=settings.http_token, detail=detail if shown else None,
                       actions=actions if shown else None, node=settings.node_id)
    try:
        server.start()
    except OSError as exc:
        metrics.close()
        source.close()
        if store is not None:
            store.observer = None
        raise ConfigError([f"setting cluster_beat_http_port: cannot listen on {settings.http_host}:"
                           f"{settings.http_port}: {exc}"]) from exc
    logger.info("cluster-beat: %s on %s%s%s%s", "status page, /metrics and /healthz" if shown else "/healthz alone",
                server.url, " (port picked by the system)" if not settings.http_port else "",
                " (the page and /metrics need the bearer token)" if shown and settings.http_token else "",
                " (actions on: run now, pause and resume with the actions token)" if shown and actions else "")
    return BeatOps(server, health, metrics, store, source)
