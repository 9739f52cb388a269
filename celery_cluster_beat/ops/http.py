"""A small read-only HTTP server inside beat: ``/metrics``, ``/healthz`` and a status page.

Started by beat when ``cluster_beat_http_port`` is set (bound to
``cluster_beat_http_host``, 127.0.0.1 unless it says otherwise; port 0 picks a
free port, which beat logs). It runs on threads of its own with fixed bounds
(:mod:`.httpserver`: a selector thread, a small worker pool, a connection cap and
read, idle and write deadlines), so a request never waits for the scheduling loop
and no client, however many or slow, can take the loop's process from it.

* ``/metrics``: the Prometheus text format of this beat's own registry (:mod:`.metrics`).
* ``/healthz``: 200 while the loop ticked within the sleep it asked for plus a margin,
  503 otherwise (for a Kubernetes liveness probe): a loop stuck in a call, or never
  coming back from one, stops ticking while this thread still answers. Answered on
  the selector thread itself: never queued behind a page being built.
* ``/``: an HTML page with what ``celery ... cluster-beat status`` and ``list`` show.
  Read-only: GET and HEAD only, no forms, no scripts, every value escaped, a strict
  Content-Security-Policy. The URLs on it are masked where they are read (no
  passwords); names and descriptions are shown as they are, escaped.

``cluster_beat_http_page=False`` serves ``/healthz`` alone (the page and ``/metrics``
answer 404); ``cluster_beat_http_token`` makes the page and ``/metrics`` require
``Authorization: Bearer <token>`` (401 without it; ``/healthz`` never needs it).
"""
from __future__ import annotations

import hmac
import html
import logging
import threading
import time
from datetime import datetime, timezone
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from ..errors import ConfigError
from ..leader.urls import mask_url
from .httpserver import BoundedHTTPServer, Limits, Request, Response

logger = logging.getLogger("celery_cluster_beat")

__all__ = ["LoopHealth", "OpsServer", "BeatOps", "start_beat_server", "render_page"]

#: /healthz tolerates this much beyond the sleep the loop asked for, at least (seconds).
MIN_HEALTH_MARGIN = 5.0
#: The status page is rebuilt at most this often (seconds): it reads the database and Redis.
PAGE_CACHE = 1.0
#: The status page reloads itself this often (seconds).
PAGE_REFRESH = 5


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


class OpsServer:
    """The HTTP server; *metrics* (``ClusterBeatMetrics``), *health* (:class:`LoopHealth`) and
    *page* (returns the status page's HTML) are each optional: a missing one answers 404.
    With *token*, the page and ``/metrics`` need ``Authorization: Bearer <token>``."""

    def __init__(self, host: str, port: int, *, metrics: Any = None, health: Optional[LoopHealth] = None,
                 page: Optional[Callable[[], str]] = None, token: Optional[str] = None,
                 limits: Optional[Limits] = None) -> None:
        self.host, self.port = host, port
        self.metrics, self.health, self.page = metrics, health, page
        self._token = token.encode() if token else None
        self.limits = limits or Limits()
        self._server: Optional[BoundedHTTPServer] = None
        self._page_lock = threading.Lock()
        self._page_cache: Tuple[float, bytes, int] = (float("-inf"), b"", 200)

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
        status, body, ctype = self.route(path)
        return self._response(status, body, ctype)

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

    def route(self, path: str) -> Tuple[int, bytes, str]:
        if path == "/metrics" and self.metrics is not None:
            from .metrics import CONTENT_TYPE

            return 200, self.metrics.exposition(), CONTENT_TYPE
        if path == "/healthz" and self.health is not None:
            ok, text = self.health.check()
            return (200 if ok else 503), (text + "\n").encode(), _TEXT
        if path in PAGE_PATHS and self.page is not None:
            status, body = self._page()
            return status, body, "text/html; charset=utf-8"
        served = [p for p, on in (("/metrics", self.metrics), ("/healthz", self.health), ("/", self.page))
                  if on is not None]
        return 404, f"not found: {', '.join(served) or 'nothing is served'}\n".encode(), _TEXT

    def _page(self) -> Tuple[int, bytes]:
        with self._page_lock:  # one build at a time; concurrent loads share it
            built, body, status = self._page_cache
            if time.monotonic() - built < PAGE_CACHE:
                return status, body
            try:
                body, status = self.page().encode(), 200
            except Exception as exc:
                logger.warning("cluster-beat http: building the status page failed: %s", mask_url(repr(exc)))
                body, status = render_error(exc).encode(), 503
            self._page_cache = (time.monotonic(), body, status)
            return status, body


# ----------------------------------------------------------------------------- the page

_STYLE = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222}
h1{font-size:1.4em}h2{font-size:1.15em;margin-top:1.6em}
table{border-collapse:collapse;margin:.4em 0}
td,th{border:1px solid #ccc;padding:.25em .6em;text-align:left;vertical-align:top;font-size:.92em}
section{overflow-x:auto}th{background:#f2f2f2}.muted{color:#777}.bad{color:#b00}
"""


def _text(value: Any) -> str:
    """One value as escaped text. Not masked: the URLs on the page are masked where they are read
    (:mod:`.report`), and masking anything else would mangle names such as ``a:b:c@d``."""
    if value is None:
        return '<span class="muted">-</span>'
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, datetime):
        value = value.isoformat()
    elif isinstance(value, float):
        value = f"{value:.3f}".rstrip("0").rstrip(".") if round(value, 3) else "0"
    return html.escape(str(value))


def _cell(value: Any) -> str:
    if isinstance(value, dict):
        return _kv_table(value)
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(v, dict) for v in value):
            return _rows_table(value)
        return ", ".join(_text(v) for v in value) or '<span class="muted">-</span>'
    return _text(value)


def _kv_table(data: Dict[str, Any]) -> str:
    rows = "".join(f"<tr><th>{_text(k)}</th><td>{_cell(v)}</td></tr>" for k, v in data.items())
    return f"<table>{rows}</table>"


def _rows_table(rows: Iterable[Dict[str, Any]], cls: str = "") -> str:
    rows = list(rows)
    columns: List[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    head = "".join(f"<th>{_text(c)}</th>" for c in columns)
    body = "".join("<tr>" + "".join(f"<td>{_cell(row.get(c))}</td>" for c in columns) + "</tr>" for row in rows)
    return f'<table class="{cls}"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'


def _section(title: str, data: Any, ident: str) -> str:
    if isinstance(data, dict):
        inner = _kv_table({k: v for k, v in data.items() if not (isinstance(v, list) and v and isinstance(v[0], dict))})
        inner += "".join(f"<h3>{_text(k)}</h3>{_rows_table(v)}" for k, v in data.items()
                         if isinstance(v, list) and v and isinstance(v[0], dict))
    elif isinstance(data, (list, tuple)):
        inner = _rows_table(data) if data else '<p class="muted">none</p>'
    else:
        inner = f"<p>{_text(data)}</p>"
    return f'<section id="{ident}"><h2>{_text(title)}</h2>{inner}</section>'


def render_page(*, title: str, node: str, status: Any, schedules: Any, health: Optional[str] = None,
                refresh: Optional[int] = PAGE_REFRESH) -> str:
    """The status page: *status* and *schedules* are what ``status`` and ``list`` print
    (their ``as_dict()``), rendered generically: every key and value is escaped."""
    now = datetime.now(timezone.utc).replace(microsecond=0).isoformat()
    meta = f'<meta http-equiv="refresh" content="{int(refresh)}">' if refresh else ""
    health_html = f'<p id="health">loop: {_text(health)}</p>' if health else ""
    return (
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">"
        f"<title>{_text(title)}</title>{meta}<style>{_STYLE}</style></head><body>"
        f"<h1>{_text(title)}</h1>"
        f'<p class="muted">served by node <span id="node">{_text(node)}</span> at {_text(now)}; read-only'
        f"{f', reloads every {int(refresh)} s' if refresh else ''}</p>{health_html}"
        f"{_section('Cluster status', status, 'status')}"
        f"{_section('Schedules', schedules, 'schedules')}"
        "</body></html>"
    )


def render_error(exc: BaseException) -> str:
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>cluster-beat status</title>"
            f'<meta http-equiv="refresh" content="{PAGE_REFRESH}"></head><body><h1>cluster-beat status</h1>'
            f'<p class="bad">cannot read the cluster state: {_text(type(exc).__name__)}: {_text(mask_url(exc))}</p>'
            "</body></html>")


def _plain(value: Any) -> Any:
    as_dict = getattr(value, "as_dict", None)
    if callable(as_dict):
        return as_dict()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


# ----------------------------------------------------------------------------- beat's glue


class BeatOps:
    """What beat holds while the server runs: the health it updates each tick, and ``stop()``."""

    def __init__(self, server: OpsServer, health: LoopHealth, metrics: Any, store: Any,
                 source: Optional["_ReportSource"] = None) -> None:
        self.server, self.health, self.metrics, self._store, self._source = server, health, metrics, store, source

    @property
    def url(self) -> str:
        return self.server.url

    def attach(self, *, lease: Any = None, also_from: Iterable[Any] = ()) -> None:
        """Beat's set-up finished (the store answered): time *lease*'s renewals (or, without a lease,
        say this node schedules) and count the signals of *also_from* (the overlap guard)."""
        for sender in also_from:
            self.metrics.also_count(sender)
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
                                 per_schedule=settings.metrics_per_schedule, sender=sender, **kwargs).connect()
    if store is not None:
        store.observer = metrics.store_observer
    health = LoopHealth(margin=max(MIN_HEALTH_MARGIN, settings.lock_ttl))
    from prometheus_client import Gauge

    Gauge("cluster_beat_tick_age_seconds", "Seconds since the scheduling loop last ticked",
          registry=metrics.registry).set_function(health.age)

    source = _ReportSource(app, settings)

    def page() -> str:
        status, schedules = source.read()
        return render_page(title=f"cluster-beat: {settings.cluster_name}", node=settings.node_id,
                           status=status, schedules=schedules, health=health.check()[1])

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


class _ReportSource:
    """What ``status`` and ``list`` print, read through a store and a Redis client of the page's
    own (opened on the first request, kept until :meth:`close`): the page's reads never queue
    behind the scheduler's connections, nor count in its claim-store metrics."""

    def __init__(self, app: Any, settings: Any) -> None:
        self.app, self.settings = app, settings
        self._store: Any = None
        self._redis: Any = None
        self._lock = threading.Lock()

    def read(self) -> Tuple[Any, Any]:
        from . import report

        with self._lock:
            if self._store is None:
                self._store = report.open_store(self.app, self.settings)
            if self._redis is None and self.settings.redis is not None:
                self._redis = self.settings.redis.client()
            status = report.cluster_status(self.app, self._store, self._redis, settings=self.settings)
            schedules = report.schedule_list(self.app, self._store)
        return _plain(status), _plain(schedules)

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
