"""The dashboard's view models: the reports' records turned into what an on-call engineer reads.

The records (:mod:`.records`, :mod:`.schedulepage`) are exact and JSON-safe: ISO stamps with
microseconds, seconds as floats, snake_case states. The page needs "in 3 min" with the exact UTC
time on hover, "1.2 s", a coloured word for an outcome, and one health line that says whether
anything is wrong. This module makes those, as plain dicts and strings, and nothing else: no
I/O, no HTML (the templates of :mod:`.pagehtml` place them, and Jinja escapes every one of
them), so hostile names and descriptions stay data all the way.

Tones (the CSS classes of badges and chips): ``ok`` green, ``info`` blue, ``warn`` amber,
``bad`` red, ``muted`` grey.
"""
from __future__ import annotations

from datetime import datetime, timezone
from typing import Any, Dict, List, Optional, Sequence, Tuple
from urllib.parse import quote, urlencode

from ..store.pagequeries import FAILURES_COUNTED, PageOrder, StateFilter
from .words import duration, relative
from .records import BACKFILL

__all__ = ["exact", "when", "tone_of", "outcome_of", "clip", "schedule_href", "health_line", "schedule_rows",
           "nodes_panel", "filters", "occurrence_rows", "detail_view", "MAX_SHOWN", "DESCRIPTION_SHOWN", "FAILURE_WINDOW"]

#: Longest text one cell shows (the rest is counted, not shown: the CLI's ``--json`` has it whole).
MAX_SHOWN = 500
#: A description shows this much in the table (the schedule's page shows up to MAX_SHOWN).
DESCRIPTION_SHOWN = 200
#: The health line counts failed runs within this many seconds.
FAILURE_WINDOW = 3600.0

#: Outcome word -> tone.
_TONES = {"succeeded": "ok", "sent": "ok", "running": "info", "claimed": "warn", "retried": "warn", "lost": "warn",
          "failed": "bad", "missed": "bad", "skipped": "muted", "leader": "ok", "up": "ok", "stopped": "muted",
          "gone": "bad"}


def clip(value: Any, limit: int = MAX_SHOWN) -> str:
    """*value* as text of at most *limit* characters, the rest counted: a stored description of a
    megabyte (written past the API) must not make every page of it megabytes."""
    text = "" if value is None else str(value)
    if len(text) > limit:
        return f"{text[:limit]}… ({len(text):,} characters)"
    return text


def first_line(value: Any, limit: int = 160) -> str:
    """The first line of an error, clipped: what a table cell shows (the page of the schedule has more)."""
    text = "" if value is None else str(value).strip()
    line = text.splitlines()[0] if text else ""
    return clip(line, limit)


def _aware(at: datetime) -> datetime:
    return at if at.tzinfo is not None else at.replace(tzinfo=timezone.utc)


def exact(at: Optional[datetime]) -> str:
    """``2026-03-01 02:30:00 UTC``: to the second, always UTC (the hover text of every time)."""
    if at is None:
        return ""
    return _aware(at).astimezone(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def when(at: Optional[datetime], now: datetime) -> Dict[str, str]:
    """``{"text": "in 3 min", "title": "2026-03-01 02:30:00 UTC", "iso": ...}`` (text ``-`` for None)."""
    if at is None:
        return {"text": "-", "title": "", "iso": ""}
    at = _aware(at)
    return {"text": relative(at, _aware(now)), "title": exact(at),
            "iso": at.astimezone(timezone.utc).replace(microsecond=0).isoformat()}


def tone_of(word: Optional[str]) -> str:
    if not word:
        return "muted"
    return _TONES.get(str(word).split(" ", 1)[0], "muted")


def outcome_of(status: Optional[str], run_state: Optional[str], reason: Optional[str] = None) -> Tuple[str, str]:
    """(word, tone) of an occurrence: its run state when the worker's ledger knows it, else its
    claim status (``claimed`` past its instant reads "unsent")."""
    if run_state:
        return str(run_state), tone_of(run_state)
    if not status:
        return "never", "muted"
    if status == "claimed":
        return "unsent", "warn"
    if status in ("skipped", "failed", "missed") and reason:
        return f"{status}", tone_of(status)
    return str(status), tone_of(status)


def schedule_href(name: str) -> str:
    """The schedule page's path: the name URL-quoted whole (``/``, ``?``, ``#`` and all)."""
    return "/schedules/" + quote(name, safe="")


# ----------------------------------------------------------------------------- the health line


def _chip(label: str, value: str, tone: str, title: str = "", href: str = "") -> Dict[str, str]:
    return {"label": label, "value": value, "tone": tone, "title": title, "href": href}


def health_line(status: Dict[str, Any], *, loop: Optional[Tuple[bool, str]], failures: Optional[int],
                counts: Dict[str, int], now: datetime) -> List[Dict[str, str]]:
    """The first line of the page: leader and term, lease time left, nodes up, unsent and overdue
    occurrences, failed runs in the last hour, and the loop's health; each a chip with a tone.
    *status*: :meth:`ClusterStatus.as_dict`; *counts*: the schedule page's attention counts."""
    chips = []
    leader, term = status.get("leader"), status.get("term")
    lease = status.get("lease") or {}
    chips.append(_chip("Leader", leader or "none", "ok" if leader else "bad",
                       "the node that holds the lease and sends" if leader else
                       "no node holds the lease: nothing is sent", "#nodes"))
    chips.append(_chip("Term", f"{term:,}" if isinstance(term, int) else "-", "muted",
                       f"fencing term (the store has {status.get('store_term', '-')})"))
    if not lease.get("enabled"):
        chips.append(_chip("Lease", "none", "warn", "no Redis lease: every replica schedules and races on claims"))
    elif lease.get("error"):
        chips.append(_chip("Lease", "unreadable", "bad", clip(lease.get("error"), 200)))
    elif lease.get("expires_in") is not None:
        left = float(lease["expires_in"])
        chips.append(_chip("Lease", f"{duration(left)} left", "ok" if left > 1 else "warn",
                           f"renewed by the leader before it expires ({lease.get('key') or ''})"))
    else:
        chips.append(_chip("Lease", "free", "bad", "nobody holds the lease"))
    nodes = status.get("nodes") or []
    up = sum(1 for n in nodes if n.get("state") in ("leader", "up"))
    gone = sum(1 for n in nodes if n.get("state") == "gone")
    chips.append(_chip("Nodes", f"{up} of {len(nodes)} up", "ok" if up and not gone else ("bad" if not up else "warn"),
                       f"{gone} gone (heartbeat lost)" if gone else "heartbeats within the claim grace", "#nodes"))
    unsent = int(status.get("unsent") or 0)
    overdue = int(counts.get("overdue") or 0)
    chips.append(_chip("Late", f"{unsent:,} unsent · {overdue:,} overdue", "bad" if unsent or overdue else "ok",
                       "claimed past the claim grace and not sent; schedules whose next occurrence is long past",
                       "?state=overdue" if overdue else ""))
    if failures is None:
        chips.append(_chip("Failed 1 h", "?", "muted", "could not be counted"))
    else:
        shown = f"{FAILURES_COUNTED:,}+" if failures > FAILURES_COUNTED else f"{failures:,}"
        chips.append(_chip("Failed 1 h", shown, "bad" if failures else "ok",
                           "occurrences of the last hour whose run failed or that were not sent",
                           "?state=failing" if failures else ""))
    if loop is not None:
        ok, text = loop
        chips.append(_chip("Loop", "ok" if ok else ("failing" if text.startswith("failing") else "stalled"),
                           "ok" if ok else "bad", text))
    return chips


# ----------------------------------------------------------------------------- the schedules table


def _counters(counters: Dict[str, Any]) -> Dict[str, Any]:
    parts = [(k.replace("_", " "), int(v or 0)) for k, v in (counters or {}).items()]
    shown = [f"{n:,} {k}" for k, n in parts if n]
    bad = sum(n for k, n in parts if k in ("failed", "missed", "claim lost"))
    return {"text": " · ".join(shown) or "none yet", "title": ", ".join(f"{k}: {n:,}" for k, n in parts),
            "tone": "bad" if bad else "muted"}


def schedule_rows(rows: Sequence[Dict[str, Any]], now: datetime) -> List[Dict[str, Any]]:
    """The table's rows from :meth:`SchedulePage.as_dict`'s ``schedules``."""
    out = []
    for r in rows:
        last_word, last_tone = outcome_of(r.get("last_status"), r.get("last_run_state"), r.get("last_reason"))
        attention = r.get("attention")
        flags = []
        if r.get("problem"):
            flags.append({"text": "invalid", "tone": "bad", "title": clip(r.get("problem"), 300)})
        if r.get("paused"):
            by, note = r.get("paused_by"), r.get("paused_note")
            title = " ".join(x for x in (f"by {by}" if by else "", f"— {note}" if note else "") if x)
            flags.append({"text": "paused", "tone": "warn", "title": clip(title, 300)})
        if not r.get("enabled", True):
            flags.append({"text": "disabled", "tone": "muted", "title": "enabled=False: never fires"})
        elif r.get("ended"):
            ended_at = _parse(r.get("ended_at"))
            flags.append({"text": "ended", "tone": "muted", "title": "no further occurrence: it never fires again"
                          + (f" (ended {exact(ended_at)})" if ended_at else "")})
        if attention == "overdue":
            flags.append({"text": "overdue", "tone": "bad", "title": "its next occurrence is long past: nobody sends it"})
        if r.get("run_requested_at"):
            flags.append({"text": "run requested", "tone": "info", "title": exact(_parse(r.get("run_requested_at")))})
        error = r.get("last_run_error") or r.get("last_error")
        out.append({
            "name": clip(r.get("name"), 255), "href": schedule_href(str(r.get("name") or "")),
            "task": clip(r.get("task"), 200), "description": clip(r.get("description"), DESCRIPTION_SHOWN),
            "source": r.get("source") or "", "owner": r.get("owner") or "",
            "rule": clip(r.get("rule") or r.get("schedule"), 200), "compact": clip(r.get("compact") or r.get("schedule"), 120),
            "zone": r.get("zone") or "", "bounds": clip(r.get("bounds"), 200) or "",
            "next": when(_parse(r.get("next_fire")), now),
            "last": {**when(_parse(r.get("last_occurrence")), now), "word": last_word, "tone": last_tone},
            "runtime": duration(r.get("last_runtime")) if r.get("last_runtime") is not None else "",
            "error": first_line(error, 140) if last_tone == "bad" else "",
            "counters": _counters(r.get("counters") or {}),
            "overlap": (r.get("overlap") or "").replace("_", " "),
            "attention": attention or "", "flags": flags,
        })
    return out


def _parse(value: Any) -> Optional[datetime]:
    if value is None or isinstance(value, datetime):
        return value
    try:
        return datetime.fromisoformat(str(value))
    except ValueError:
        return None


def filters(shown: Dict[str, Any]) -> Dict[str, Any]:
    """The filter bar: the current ``q``, ``state`` and ``sort``, the choices with their counts, the
    "showing N of M" line and the link to a longer page."""
    counts = dict(shown.get("counts") or {})
    counts["running"] = shown.get("running") or 0
    query, state, sort = shown.get("query") or "", shown.get("state") or "", shown.get("sort") or "attention"
    limit, total, count = int(shown.get("limit") or 0), int(shown.get("total") or 0), int(shown.get("shown") or 0)
    matching = shown.get("matching")
    states = [{"value": "", "text": "every state"}] + [
        {"value": s.value, "text": f"{s.value} ({counts[s.value]:,})" if s.value in counts else s.value}
        for s in StateFilter]
    sorts = [{"value": o.value, "text": {"attention": "needs attention first", "name": "name", "next": "next fire",
                                         "last": "last run"}[o.value]} for o in PageOrder]
    more = ""
    if (matching if matching is not None else total) > count and limit < 500:
        more = "?" + urlencode({k: v for k, v in (("q", query), ("state", state),
                                                   ("sort", sort if sort != "attention" else ""), ("limit", 500)) if v})
    return {"q": query, "state": state, "sort": sort, "limit": limit, "states": states, "sorts": sorts,
            "shown": count, "total": total, "matching": matching, "more": more,
            "attention": [{"state": k, "n": int(v)} for k, v in counts.items() if v]}


# ----------------------------------------------------------------------------- nodes


def nodes_panel(status: Dict[str, Any]) -> List[Dict[str, Any]]:
    out = []
    now = _parse(status.get("now")) or datetime.now(timezone.utc)
    for n in status.get("nodes") or []:
        offset = n.get("clock_offset")
        off_text = "-" if offset is None else ("in step" if abs(offset) < 0.05 else
                                               f"{'ahead' if offset < 0 else 'behind'} {duration(abs(offset))}")
        out.append({"node": clip(n.get("node"), 255), "state": n.get("state") or "", "tone": tone_of(n.get("state")),
                    "age": duration(n.get("heartbeat_age")) + " ago" if n.get("heartbeat_age") is not None else "-",
                    "heartbeat": exact(_parse(n.get("heartbeat_at"))), "offset": off_text,
                    "offset_bad": offset is not None and abs(offset) > 1.0,
                    "scheduling": "yes" if n.get("scheduling") else "no",
                    "started": when(_parse(n.get("started_at")), now)})
    return out


# ----------------------------------------------------------------------------- one schedule


def occurrence_rows(recent: Sequence[Any], now: datetime) -> List[Dict[str, Any]]:
    """The schedule page's occurrences (claim rows with the ledger's columns), newest first."""
    out = []
    for row in recent:
        word, tone = outcome_of(row.status, row.run_state, row.reason)
        late = (row.sent_at - row.scheduled_at).total_seconds() if row.sent_at is not None else None
        error = row.run_error or (row.reason if row.status in ("failed", "missed", "skipped") else None)
        worker = f"{row.worker}:{row.worker_pid}" if row.worker and row.worker_pid else (row.worker or "")
        out.append({"at": when(row.scheduled_at, now), "late": duration(late) if late is not None else "-",
                    "late_s": late, "runtime": duration(row.runtime) if row.runtime is not None else "-",
                    "runtime_s": row.runtime, "word": word, "tone": tone, "error": first_line(error, 300),
                    "node": clip(row.node, 255), "worker": clip(worker, 255), "task_id": row.task_id,
                    "manual": (row.reason or "").startswith("manual"), "backfill": BACKFILL in (row.origin, row.reason),
                    "attempts": row.attempts})
    return out


def detail_view(detail: Any) -> Dict[str, Any]:
    """What the schedule page shows of a :class:`~.schedulepage.ScheduleDetail`."""
    now = detail.now
    info = detail.info.as_dict() if detail.info is not None else None
    if info is not None:  # its last occurrence's run, from the rows read (newest first; one ahead may be claimed)
        last = next((r for r in detail.recent if _aware(r.scheduled_at) <= _aware(now)), None)
        info["last_runtime"] = last.runtime if last is not None else None
        info["last_run_error"] = last.run_error if last is not None else None
    row = schedule_rows([{**info, "attention": detail.attention.value if detail.attention else None}], now)[0] \
        if info is not None else None
    recent = occurrence_rows(detail.recent, now)
    ran = [r for r in recent if r["runtime_s"] is not None]
    failed = sum(1 for r in recent if r["tone"] == "bad")
    return {"name": clip(detail.name, 255), "href": schedule_href(detail.name), "info": info, "row": row,
            "running": detail.running, "upcoming": [when(at, now) for at in detail.upcoming], "recent": recent,
            "paused_by": info.get("paused_by") if info else None, "paused_note": info.get("paused_note") if info else None,
            "paused_at": when(_parse(info.get("paused_at")), now) if info else None,
            "summary": {"shown": len(recent), "failed": failed,
                        "runtime_avg": duration(sum(r["runtime_s"] for r in ran) / len(ran)) if ran else "-",
                        "runtime_max": duration(max(r["runtime_s"] for r in ran)) if ran else "-"}}
