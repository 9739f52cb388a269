"""The status page's HTML: every value escaped, no forms, no scripts, nothing fetched.

Kept apart from the server (:mod:`.http`) because it is what a hostile name or
description reaches: rendering is generic (keys and values of the reports' ``as_dict()``),
and :func:`_text` is the one place a value becomes HTML. Values are escaped, never masked:
the URLs on the page are masked where they are read (:mod:`.report`), and masking
anything else would mangle names such as ``a:b:c@d``.
"""
from __future__ import annotations

import html
from datetime import datetime, timezone
from typing import Any, Dict, Iterable, List, Optional
from urllib.parse import urlencode

from ..leader.urls import mask_url

__all__ = ["render_page", "render_error", "PAGE_REFRESH"]

#: The status page reloads itself this often (seconds).
PAGE_REFRESH = 5
#: Longest text one cell shows (the rest is counted, not shown: the CLI's ``--json`` has it whole).
MAX_SHOWN = 500

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
    text = str(value)
    if len(text) > MAX_SHOWN:  # a description of a megabyte would make every page of it megabytes
        text = f"{text[:MAX_SHOWN]}… ({len(text):,} characters)"
    return html.escape(text)


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


def _shown(summary: Dict[str, Any]) -> str:
    """The line above the schedules: how many of how many, in which order, and how to see others."""
    query, limit, total = summary.get("query"), int(summary.get("limit") or 0), int(summary.get("total") or 0)
    counts = summary.get("counts") or {}
    matching = f" whose name contains &#8220;{_text(query)}&#8221; (any case)" if query else ""
    attention = ", ".join(f"{int(n):,} {_text(k)}" for k, n in counts.items())
    more = ""
    if total > int(summary.get("shown") or 0):
        wider = urlencode({k: v for k, v in (("q", query), ("limit", 500)) if v})
        more = f'; show up to 500 with <a href="?{html.escape(wider)}">?limit=500</a>'
    return (f'<p id="shown">showing {int(summary.get("shown") or 0):,} of {total:,} schedules{matching}'
            f'{f" ({attention})" if attention else ""}: failing, paused and overdue ones first, then the next '
            f"to fire (at most {limit:,} a page). Filter by name with <code>?q=text</code>{more}.</p>")


def render_page(*, title: str, node: str, status: Any, schedules: Any, health: Optional[str] = None,
                refresh: Optional[int] = PAGE_REFRESH, shown: Optional[Dict[str, Any]] = None) -> str:
    """The status page: *status* and *schedules* are what ``status`` and ``list`` print
    (their ``as_dict()``), rendered generically: every key and value is escaped. *shown*: the
    summary of a :class:`~.schedulepage.SchedulePage` whose rows *schedules* are."""
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
        f"{_shown(shown) if shown is not None else ''}"
        f"{_section('Schedules', schedules, 'schedules')}"
        "</body></html>"
    )


def render_error(exc: BaseException) -> str:
    """The page served (with a 503) when the cluster state cannot be read: the error's class and
    first words, URLs masked and escaped, and the same refresh as the page, so a browser left open
    on it comes back by itself once the database answers."""
    return ("<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\"><title>cluster-beat status</title>"
            f'<meta http-equiv="refresh" content="{PAGE_REFRESH}"></head><body><h1>cluster-beat status</h1>'
            f'<p class="bad">cannot read the cluster state: {_text(type(exc).__name__)}: {_text(mask_url(exc))}</p>'
            "</body></html>")
