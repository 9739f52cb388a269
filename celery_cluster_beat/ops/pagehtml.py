"""The dashboard's HTML: Jinja2 templates with autoescaping, no scripts, nothing fetched.

Kept apart from the server (:mod:`.http`) because it is what a hostile name or description
reaches. The view models (:mod:`.dashboard`) are plain strings and numbers; the templates
(``templates/*.html``, package files) place them, and Jinja escapes every value it prints
(``autoescape`` on for every template, whatever its name). The only markup that is not a
template's own is the chart's SVG (:mod:`.dashboardchart`), built from numbers with its texts
escaped. The stylesheet (``templates/dashboard.css``) is read once at import and inlined: the
page fetches nothing (no CDN, no fonts), as its Content-Security-Policy requires.

Values are escaped, never masked: the URLs on the page are masked where they are read
(:mod:`.report`), and masking anything else would mangle names such as ``a:b:c@d``. A value is
shown up to :data:`MAX_SHOWN` characters, the rest counted (:func:`.dashboard.clip`).
"""
from __future__ import annotations

from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Dict, Optional, Sequence, Tuple

import jinja2
from markupsafe import Markup, escape

from ..leader.urls import mask_url
from . import dashboard as dash
from .dashboard import MAX_SHOWN, clip
from .dashboardchart import runs_chart

__all__ = ["render_page", "render_schedule", "render_message", "render_error", "PAGE_REFRESH", "MAX_SHOWN"]

#: The pages reload themselves this often (seconds); a schedule page with action forms does not
#: (a reload would wipe what the operator is typing).
PAGE_REFRESH = 10

_TEMPLATES = Path(__file__).resolve().parent / "templates"
_ENV = jinja2.Environment(loader=jinja2.FileSystemLoader(str(_TEMPLATES)), autoescape=True,
                          undefined=jinja2.StrictUndefined, trim_blocks=True, lstrip_blocks=True)
#: Trusted: the package's own file, not data.
_CSS = Markup((_TEMPLATES / "dashboard.css").read_text(encoding="utf-8"))


def _text(value: Any) -> str:
    """One value as escaped, bounded text (what every cell shows): ``-`` for None."""
    if value is None:
        return '<span class="muted">-</span>'
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, datetime):
        value = dash.exact(value)
    elif isinstance(value, float):
        value = f"{value:.3f}".rstrip("0").rstrip(".") if round(value, 3) else "0"
    return str(escape(clip(value)))


def _common(title: str, node: str, refresh: Optional[int], actions: Optional[bool]) -> Dict[str, Any]:
    now = datetime.now(timezone.utc).replace(microsecond=0)
    return {"title": clip(title, 200), "node": clip(node, 255), "refresh": refresh, "actions": actions, "css": _CSS,
            "goto": None,
            "generated": now.strftime("%H:%M:%S UTC"), "generated_iso": now.isoformat()}


def _cluster(status: Dict[str, Any], now: datetime) -> Dict[str, Any]:
    """The collapsed cluster details, with defaults for anything a report left out."""
    paused = [{"name": clip(p.get("name"), 255), "href": dash.schedule_href(str(p.get("name") or "")),
               "by": clip(p.get("paused_by"), 100), "note": clip(p.get("paused_note"), 200)}
              for p in status.get("paused_details") or ()]
    if not paused:
        paused = [{"name": clip(n, 255), "href": dash.schedule_href(str(n)), "by": "", "note": ""}
                  for n in status.get("paused") or ()]
    unsent = [{"schedule": clip(u.get("schedule"), 255), "href": dash.schedule_href(str(u.get("schedule") or "")),
               "at": dash.when(dash._parse(u.get("scheduled_at")), now), "node": clip(u.get("node"), 255),
               "reason": clip(u.get("reason"), 200)} for u in status.get("unsent_shown") or ()]
    full = {"cluster_name": "", "db_url": "", "schema_version": "", "code_schema_version": "", "schedules": 0,
            "config_schedules": 0, "stored_schedules": 0, "paused_count": len(paused), "unsent": len(unsent),
            "lease": {}}
    full.update({k: v for k, v in status.items() if v is not None})
    full["lease"] = {"enabled": False, "key": "", "redis_url": "", "error": "", **(status.get("lease") or {})}
    return {"status": full, "paused": paused, "unsent": unsent,
            "grace": dash.duration(status.get("claim_grace")) if status.get("claim_grace") is not None else "-"}


def render_page(*, title: str, node: str, status: Dict[str, Any], schedules: Sequence[Dict[str, Any]],
                health: Optional[Tuple[bool, str]] = None, refresh: Optional[int] = PAGE_REFRESH,
                shown: Optional[Dict[str, Any]] = None, failures: Optional[int] = None,
                actions: bool = False) -> str:
    """The dashboard: the health line, the schedules table and the nodes panel. *status*:
    :meth:`ClusterStatus.as_dict`; *schedules* and *shown*: a :class:`~.schedulepage.SchedulePage`'s
    ``as_dict()`` rows and the rest of it; *health*: the loop's ``(ok, text)``; *failures*: failed
    occurrences of the last hour (None: not counted)."""
    now = dash._parse(status.get("now")) or datetime.now(timezone.utc)
    shown = shown or {"shown": len(schedules), "total": len(schedules), "limit": len(schedules)}
    context = _common(title, node, refresh, actions)
    context.update(_cluster(status, now))
    context.update(chips=dash.health_line(status, loop=health, failures=failures, counts=shown.get("counts") or {},
                                          now=now),
                   f=dash.filters(shown), rows=dash.schedule_rows(schedules, now), nodes=dash.nodes_panel(status))
    return _ENV.get_template("index.html").render(context)


def render_schedule(*, title: str, node: str, detail: Any, actions: bool = False,
                    refresh: Optional[int] = PAGE_REFRESH, notice: Optional[Dict[str, str]] = None) -> str:
    """One schedule's page (a :class:`~.schedulepage.ScheduleDetail`): what it is, its next fires,
    its latest occurrences with a chart, and with *actions* the forms to run, pause or resume it."""
    view = dash.detail_view(detail)
    context = _common(title, node, None if actions else refresh, actions)
    context.update(d=view, chart=runs_chart(view["recent"]), notice=notice)
    return _ENV.get_template("schedule.html").render(context)


def render_message(*, title: str, node: str, text: str, tone: str = "", back: Optional[str] = None,
                   refresh: Optional[int] = None, goto: Optional[str] = None) -> str:
    """A one-line page: what an action did, or why it was refused; with *goto* (a path of this
    server) it goes there after *refresh* seconds."""
    context = _common(title, node, refresh, None)
    context.update(text=clip(text, 1000), tone=tone, back=back, goto=goto)
    return _ENV.get_template("message.html").render(context)


def render_error(exc: BaseException) -> str:
    """The page served (with a 503) when the cluster state cannot be read: the error's class and
    first words, URLs masked and escaped, and the same refresh as the page, so a browser left open
    on it comes back by itself once the database answers."""
    return render_message(title="cluster-beat status", node="", tone="bad", refresh=PAGE_REFRESH,
                          text=f"cannot read the cluster state: {type(exc).__name__}: {mask_url(exc)}")
