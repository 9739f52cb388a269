"""``celery ... cluster-beat backfill NAME --from T1 --to T2``: the command's side of a backfill.

The command plans (which occurrences the range holds, and what a backfill would do with each:
the rule of :mod:`..store.backfill`, read from the claim rows) and, unless ``--dry-run``,
records a request for the leader (:func:`request`), then waits for its result (:func:`wait`).
It never claims nor publishes anything itself: only the leader does, through its send pipeline,
so a backfill is fenced, retried and resent like any occurrence. Without a leader running the
request stays pending and is served by the next one.

Instants are ISO 8601 (``2026-01-05T09:00``, ``2026-01-05 09:00+01:00``, ``...Z``); one without
an offset is UTC. The range is inclusive; ``--to`` may not be after the claim database's clock.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Dict, List, Optional, Tuple

from ..config import Entry
from ..config.settings import Settings
from ..dynamic.convert import entry_from_row
from ..store import ClaimStore
from ..store.backfill import BackfillRequest, NotSent, backfill_problem, fires_between, verdict
from ..store.schema import BackfillState
from .report import NoSuchSchedule, act_on_schedule, config_entries, open_store, schedule_source

#: Seconds the command polls for the leader's result.
POLL = 0.25


def parse_instant(text: str, option: str) -> datetime:
    """The aware UTC instant of an ISO 8601 *text* (UTC when it has no offset); ValueError naming *option*."""
    value = (text or "").strip()
    try:
        parsed = datetime.fromisoformat(value[:-1] + "+00:00" if value.endswith(("Z", "z")) else value)
    except ValueError:
        raise ValueError(f"{option}: not an ISO 8601 instant: {text!r} (e.g. 2026-01-05T09:00, "
                         "2026-01-05 09:00+01:00; no offset: UTC)") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=timezone.utc)
    return parsed.astimezone(timezone.utc)


@dataclass(frozen=True)
class Plan:
    """What a backfill of *name* over [*start*, *end*] would do, read at the database's time *now*:
    each instant with None (it would be sent) or why it would not (:class:`~..store.backfill.NotSent`)."""

    name: str
    source: str
    start: datetime
    end: datetime
    limit: int
    now: datetime
    items: List[Tuple[datetime, Optional[NotSent]]]
    #: What the operator should know before sending (rows the overlap guard skipped, sent anyway).
    warnings: Tuple[str, ...] = ()

    @property
    def to_send(self) -> List[datetime]:
        return [at for at, why in self.items if why is None]

    def not_sent(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for _, why in self.items:
            if why is not None:
                out[why.value] = out.get(why.value, 0) + 1
        return out

    def as_dict(self) -> Dict[str, Any]:
        return {"schedule": self.name, "source": self.source, "from": self.start.isoformat(),
                "to": self.end.isoformat(), "limit": self.limit, "dry_run": True,
                "would_send": len(self.to_send), "not_sent": self.not_sent(), "warnings": list(self.warnings),
                "occurrences": [{"scheduled_at": at.isoformat(), "send": why is None,
                                 "reason": None if why is None else why.value} for at, why in self.items]}


def _entry(app: Any, name: str, source: str, store: ClaimStore) -> Entry:
    if source == "config":
        return config_entries(app)[name]
    rows = store.stored_get([name])
    if not rows:
        raise NoSuchSchedule(name)
    return entry_from_row(rows[0], app=app)


def plan(app: Any, store: ClaimStore, name: str, start: datetime, end: datetime, limit: int,
         retention: Optional[float] = None) -> Plan:
    """The dry run: read-only (ValueError for a bad range or limit, a range over *limit*, or one
    starting more than *retention* seconds, the claim retention, before the database's time)."""
    source = schedule_source(app, name, store)
    entry = _entry(app, name, source, store)
    now = store.db_now()
    problem = backfill_problem(start, end, now, limit, retention)
    if problem:
        raise ValueError(problem)
    instants = fires_between(entry.schedule, start, end, limit)
    if len(instants) > limit:
        raise ValueError(f"the range holds more than {limit} occurrences of {name!r}: narrow it, or raise "
                         "--limit (at most 10000)")
    rows = store.backfill_rows(name, instants)
    items = [(at, verdict(*rows[at]) if at in rows else None) for at in instants]
    return Plan(name, source, start, end, limit, now, items, _warnings(store, name, items, rows))


def _warnings(store: ClaimStore, name: str, items: List[Tuple[datetime, Optional[NotSent]]],
              rows: Dict[datetime, Any]) -> Tuple[str, ...]:
    """Rows the overlap guard skipped (``overlap=skip``: a run was still in flight) that the backfill
    would send: it sends without the guard, so those runs may overlap."""
    skipped = [at for at, why in items if why is None and at in rows and rows[at][0] == "skipped"]
    if not skipped:
        return ()
    overlap = [at for at, (_, reason) in store.backfill_outcomes(name, skipped).items() if reason == "overlap"]
    if not overlap:
        return ()
    return (f"{len(overlap)} of the occurrences to send were skipped by the overlap guard (overlap=skip: a run "
            "was still in flight); a backfill sends them without the guard, so their runs may overlap",)


def request(app: Any, settings: Settings, name: str, start: datetime, end: datetime, limit: int,
            by: str) -> Tuple[BackfillRequest, Plan]:
    """Check the range as the dry run does, then record the request and tell the leader."""
    store = open_store(app, settings)
    try:
        planned = plan(app, store, name, start, end, limit, settings.claim_retention)
    finally:
        store.close()
    (_, recorded), _ = act_on_schedule(app, settings, name, lambda st: st.request_backfill(
        name, start, end, limit=limit, by=by, retention=settings.claim_retention))
    return recorded, planned


def wait(app: Any, settings: Settings, request_id: str, timeout: float) -> BackfillRequest:
    """The request once a leader handled it, or as it stands after *timeout* seconds (pending)."""
    store = open_store(app, settings)
    try:
        deadline = time.monotonic() + timeout
        while True:
            found = store.backfill_request(request_id)
            if found is None or found.state != BackfillState.PENDING.value or time.monotonic() >= deadline:
                if found is None:
                    raise ValueError(f"backfill request {request_id} is gone (the table was cleared?)")
                return found
            time.sleep(POLL)
    finally:
        store.close()


def result_dict(found: BackfillRequest) -> Dict[str, Any]:
    return {"request": found.id, "schedule": found.schedule, "from": found.from_at.isoformat(),
            "to": found.to_at.isoformat(), "limit": found.max_count, "state": found.state.value,
            "sent": found.sent, "not_sent": found.not_sent, "failed": found.failed, "retrying": found.retrying,
            "done_to": None if found.done_to is None else found.done_to.isoformat(), "error": found.error,
            "node": found.node, "finished_at": None if found.finished_at is None else found.finished_at.isoformat()}
