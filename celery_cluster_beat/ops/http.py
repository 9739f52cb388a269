"""A small read-only HTTP server inside beat: ``/metrics``, ``/healthz`` and a status page.

Started by beat when ``cluster_beat_http_port`` is set (bound to
``cluster_beat_http_host``, 127.0.0.1 unless it says otherwise; port 0 picks a
free port, which beat logs). The standard library's
:class:`~http.server.ThreadingHTTPServer` runs in a daemon thread, so a
request never waits for the scheduling loop and the loop never waits for a
request.

* ``/metrics``: the Prometheus text format of this beat's own registry (:mod:`.metrics`).
* ``/healthz``: 200 while the loop ticked within the sleep it asked for plus a margin,
  503 otherwise (for a Kubernetes liveness probe): a loop stuck in a call, or never
  coming back from one, stops ticking while this thread still answers.
* ``/``: an HTML page with what ``celery ... cluster-beat status`` and ``list`` show.
  Read-only: GET and HEAD only, no forms, no scripts, every value escaped, URLs
  masked (no passwords), a strict Content-Security-Policy.
"""
from __future__ import annotations

import html
import logging
import threading
import time
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from ..errors import ConfigError
from ..leader.urls import mask_url

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


class _Handler(BaseHTTPRequestHandler):
    server_version = "celery-cluster-beat"
    sys_version = ""
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:  # noqa: N802 (the stdlib's naming)
        self._respond(head=False)

    def do_HEAD(self) -> None:  # noqa: N802
        self._respond(head=True)

    def _refuse(self) -> None:
        self._send(405, b"read-only: GET and HEAD only\n", "text/plain; charset=utf-8", head=False,
                   extra={"Allow": "GET, HEAD"})

    do_POST = do_PUT = do_DELETE = do_PATCH = _refuse  # noqa: N815

    def _respond(self, head: bool) -> None:
        ops: OpsServer = self.server.ops  # type: ignore[attr-defined]
        path = self.path.split("?", 1)[0]
        try:
            status, body, ctype = ops.route(path)
        except Exception as exc:  # a broken page must not kill the server thread
            logger.exception("cluster-beat http: %s failed", path)
            status, body, ctype = 500, f"error: {mask_url(type(exc).__name__)}\n".encode(), "text/plain; charset=utf-8"
        self._send(status, body, ctype, head=head)

    def _send(self, status: int, body: bytes, ctype: str, *, head: bool, extra: Optional[Dict[str, str]] = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.send_header("Referrer-Policy", "no-referrer")
        self.send_header("Content-Security-Policy",
                         "default-src 'none'; style-src 'unsafe-inline'; form-action 'none'; frame-ancestors 'none'")
        for k, v in (extra or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if not head:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
        logger.debug("cluster-beat http: %s - %s", self.address_string(), format % args)


class OpsServer:
    """The HTTP server; *metrics* (``ClusterBeatMetrics``), *health* (:class:`LoopHealth`) and
    *page* (returns the status page's HTML) are each optional: a missing one answers 404."""

    def __init__(self, host: str, port: int, *, metrics: Any = None, health: Optional[LoopHealth] = None,
                 page: Optional[Callable[[], str]] = None) -> None:
        self.host, self.port = host, port
        self.metrics, self.health, self.page = metrics, health, page
        self._httpd: Optional[ThreadingHTTPServer] = None
        self._thread: Optional[threading.Thread] = None
        self._page_lock = threading.Lock()
        self._page_cache: Tuple[float, bytes, int] = (float("-inf"), b"", 200)

    @property
    def url(self) -> str:
        host = self.host if ":" not in self.host else f"[{self.host}]"
        return f"http://{host}:{self.port}/"

    def start(self) -> "OpsServer":
        server_class = ThreadingHTTPServer
        if ":" in self.host:  # an IPv6 literal
            import socket

            server_class = type("ThreadingHTTPServer6", (ThreadingHTTPServer,), {"address_family": socket.AF_INET6})
        httpd = server_class((self.host, self.port), _Handler)
        httpd.daemon_threads = True
        httpd.ops = self  # type: ignore[attr-defined]
        self.port = httpd.server_address[1]
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.25},
                                        name="cluster-beat-http", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        httpd, self._httpd = self._httpd, None
        if httpd is None:
            return
        httpd.shutdown()
        httpd.server_close()
        if self._thread is not None:
            self._thread.join(5)

    def route(self, path: str) -> Tuple[int, bytes, str]:
        if path == "/metrics" and self.metrics is not None:
            from .metrics import CONTENT_TYPE

            return 200, self.metrics.exposition(), CONTENT_TYPE
        if path == "/healthz" and self.health is not None:
            ok, text = self.health.check()
            return (200 if ok else 503), (text + "\n").encode(), "text/plain; charset=utf-8"
        if path in ("/", "/index.html") and self.page is not None:
            status, body = self._page()
            return status, body, "text/html; charset=utf-8"
        return 404, b"not found: /metrics, /healthz, /\n", "text/plain; charset=utf-8"

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
    """One value as escaped, masked text."""
    if value is None:
        return '<span class="muted">-</span>'
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, datetime):
        value = value.isoformat()
    elif isinstance(value, float):
        value = f"{value:.3f}".rstrip("0").rstrip(".") if round(value, 3) else "0"
    return html.escape(mask_url(str(value)))


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
    (their ``as_dict()``), rendered generically: every key and value is escaped and masked."""
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
            f'<p class="bad">cannot read the cluster state: {_text(type(exc).__name__)}: {_text(exc)}</p>'
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

    server = OpsServer(settings.http_host, settings.http_port, metrics=metrics, health=health, page=page)
    try:
        server.start()
    except OSError as exc:
        metrics.close()
        source.close()
        if store is not None:
            store.observer = None
        raise ConfigError([f"setting cluster_beat_http_port: cannot listen on {settings.http_host}:"
                           f"{settings.http_port}: {exc}"]) from exc
    logger.info("cluster-beat: status page, /metrics and /healthz on %s%s", server.url,
                " (port picked by the system)" if not settings.http_port else "")
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
