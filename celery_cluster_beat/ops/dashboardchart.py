"""The schedule page's small chart: runtime and lateness of its latest occurrences, as inline SVG.

Drawn on the server, no script and nothing fetched (the page's Content-Security-Policy allows
neither): one bar a run, oldest on the left, its height the runtime (a run that failed red, one
still running blue), and below it the lateness (sent minus scheduled) of each occurrence. Every
number is formatted here and every text goes through :func:`markupsafe.escape`, so the only
markup is this module's own. It scales with the page (``viewBox``, width 100 %): readable on a
phone as on a wide screen.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Union

from markupsafe import Markup, escape

__all__ = ["runs_chart"]

_W, _BAR_H, _LATE_H, _GAP, _TOP = 600.0, 70.0, 34.0, 10.0, 2.0
_COLOURS = {"ok": "#2e9e5b", "bad": "#d64545", "warn": "#d99a1e", "info": "#3b7dd8", "muted": "#9aa3ad"}


def _num(x: float) -> str:
    return f"{x:.1f}".rstrip("0").rstrip(".")


def runs_chart(rows: Sequence[Dict[str, Any]]) -> Optional[Dict[str, Union[Markup, str]]]:
    """``{"svg": ..., "runtime_max": "1.2 s", "late_max": "80 ms"}`` of *rows*
    (:func:`.dashboard.occurrence_rows`, newest first), or None when no occurrence has a runtime or
    a lateness to draw. The SVG stretches to the width it is given (its labels are the page's
    text, not the drawing's, so they stay legible at any width)."""
    rows = list(reversed(rows))  # oldest on the left
    runtimes = [r["runtime_s"] for r in rows if r.get("runtime_s") is not None]
    lates = [max(0.0, r["late_s"]) for r in rows if r.get("late_s") is not None]
    if not runtimes and not lates:
        return None
    top_run = max(runtimes or [0.0]) or 1.0
    top_late = max(lates or [0.0]) or 1.0
    step = _W / max(len(rows), 1)
    width = max(1.0, step * 0.72)
    base_run = _TOP + _BAR_H
    base_late = base_run + _GAP + _LATE_H
    parts: List[str] = []
    for i, r in enumerate(rows):
        x = i * step + (step - width) / 2
        label = escape(f"{r['at']['title']}: {r['word']}, runtime {r['runtime']}, late by {r['late']}")
        if r.get("runtime_s") is not None:
            h = max(1.5, _BAR_H * r["runtime_s"] / top_run)
            parts.append(f'<rect x="{_num(x)}" y="{_num(base_run - h)}" width="{_num(width)}" height="{_num(h)}" '
                         f'fill="{_COLOURS.get(r["tone"], _COLOURS["muted"])}" rx="1.5"><title>{label}</title></rect>')
        elif r["tone"] in ("bad", "info"):  # failed without a runtime (not sent) or running: a marker
            parts.append(f'<rect x="{_num(x)}" y="{_num(base_run - 4)}" width="{_num(width)}" height="4" '
                         f'fill="{_COLOURS[r["tone"]]}"><title>{label}</title></rect>')
        if r.get("late_s") is not None:
            h = max(1.0, _LATE_H * max(0.0, r["late_s"]) / top_late)
            parts.append(f'<rect x="{_num(x)}" y="{_num(base_late - h)}" width="{_num(width)}" height="{_num(h)}" '
                         f'fill="#8a94a6" rx="1"><title>{label}</title></rect>')
    from .words import duration

    height = base_late + 2
    axis = (f'<line x1="0" x2="{_W:.0f}" y1="{_num(base_run)}" y2="{_num(base_run)}" stroke="#c8ced6"/>'
            f'<line x1="0" x2="{_W:.0f}" y1="{_num(base_late)}" y2="{_num(base_late)}" stroke="#c8ced6"/>')
    svg = Markup(f'<svg class="chart" viewBox="0 0 {_W:.0f} {_num(height)}" preserveAspectRatio="none" '
                 f'role="img" aria-label="runtime and lateness of the latest occurrences, oldest first">'
                 f'{axis}{"".join(parts)}</svg>')
    return {"svg": svg, "runtime_max": duration(top_run) if runtimes else "-",
            "late_max": duration(top_late) if lates else "-"}
