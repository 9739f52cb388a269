"""``beat_schedule`` entries: validated once at start-up into :class:`Entry` objects.

All problems of all entries are collected into one :class:`ConfigError`, each
naming the entry, the field and the reason; nothing is started on bad input.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Dict, List, Mapping, Optional, Tuple

from ..base import MAX_NAME_LENGTH
from ..errors import ConfigError, ScheduleError
from ..schedules import ClusterSchedule, as_schedule, bounded
from ..schedules.bounds import runs_problem
from ..schedules.rules import parse_instant
from .options import option_problems
from .values import (MAX_SECONDS, MAX_TEXT_BYTES, CatchupPolicy, OverlapPolicy, choice_problem, description_problem,
                     count_problem, seconds_problem, shown, text_problem)

CELERY_KEYS = ("task", "schedule", "args", "kwargs", "options", "relative")
OUR_KEYS = ("overlap", "max_run_time", "jitter", "catchup", "catchup_window", "enabled", "description",
            "pause_after_failures")
#: Most consecutive failed runs ``pause_after_failures`` may wait for.
MAX_PAUSE_AFTER_FAILURES = 10000
#: Bounds on when an entry fires (schedules/bounds.py); kept apart: a stored schedule has columns for them.
BOUND_KEYS = ("start_at", "end_at", "max_runs")


@dataclass
class Entry:
    """One schedule entry. Per-entry policy fields are ``None`` when the global setting applies."""

    name: str
    task: str
    schedule: ClusterSchedule
    args: Tuple = ()
    kwargs: Dict[str, Any] = field(default_factory=dict)
    options: Dict[str, Any] = field(default_factory=dict)
    overlap: Optional[OverlapPolicy] = None
    max_run_time: Optional[float] = None
    jitter: Optional[float] = None
    catchup: Optional[CatchupPolicy] = None
    catchup_window: Optional[float] = None
    enabled: bool = True
    description: str = ""
    #: Pause the schedule after this many consecutive failed runs (None: never; see beat.failures).
    pause_after_failures: Optional[int] = None
    #: Why this (stored) entry must not be sent, though its instants are known: a field out of range
    #: in its row (written by hand or by another release). Each occurrence ends ``failed`` with it.
    refused: Optional[str] = None
    #: The same reasons, each with the row's column it is about (``options``, ``catchup_window``):
    #: an update that leaves that column as it is is not refused for it.
    refusals: Tuple[Tuple[str, str], ...] = ()
    #: Where the entry comes from: None for ``beat_schedule``; for a stored schedule the
    #: version of its definition (the leader's writes about it are conditional on it).
    stored_version: Optional[int] = None
    owner: Optional[str] = None
    # Celery's ScheduleEntry exposes these; tools that read beat's schedule expect them.
    last_run_at: Optional[datetime] = None
    total_run_count: int = 0


def _check_schedule(spec: Any, app: Any) -> Tuple[Optional[ClusterSchedule], Optional[str]]:
    """The entry's schedule, or why it cannot be one (never an exception: a number too big for
    an interval is bad input like any other)."""
    try:
        schedule = as_schedule(spec, app=app)
    except ScheduleError as exc:
        return None, str(exc)
    except (OverflowError, ValueError, TypeError, ArithmeticError) as exc:
        return None, f"cannot be read as a schedule ({exc.__class__.__name__}: {exc})"
    step = getattr(schedule, "step_us", None)
    if isinstance(step, int) and step > MAX_SECONDS * 1_000_000:  # its next fires leave datetime's range
        return None, f"interval longer than {MAX_SECONDS:.0f} s (100 years)"
    return schedule, None


_CELERY_KEYS = frozenset(CELERY_KEYS)
_OUR_KEYS = frozenset(OUR_KEYS + BOUND_KEYS)


def _bounds(spec: Mapping[str, Any], schedule: Optional[ClusterSchedule], origin: Optional[datetime],
            bad: Any, runs_end: Optional[datetime] = None) -> Optional[ClusterSchedule]:
    """*schedule* with the entry's ``start_at`` / ``end_at`` / ``max_runs`` (itself when it has none);
    each problem reported through *bad(field, reason)*."""
    given = {key: spec.get(key) for key in BOUND_KEYS if spec.get(key) is not None}
    if not given:
        return schedule
    when: Dict[str, datetime] = {}
    for key in ("start_at", "end_at"):
        if key in given:
            try:
                when[key] = parse_instant(given[key], "")
            except ScheduleError as exc:
                bad(key, str(exc))
    if "start_at" in when and "end_at" in when and when["end_at"] < when["start_at"]:
        bad("end_at", f"{when['end_at'].isoformat()} is before start_at {when['start_at'].isoformat()}")
        return None
    reason = runs_problem(given["max_runs"]) if "max_runs" in given else None
    if reason:
        bad("max_runs", reason)
        return None
    if schedule is None or len(when) < len(given) - ("max_runs" in given):
        return None
    rule = bounded(schedule, start_at=when.get("start_at"), end_at=when.get("end_at"),
                   max_runs=given.get("max_runs"), origin=origin, runs_end=runs_end)
    try:
        rule.last_instant()  # its count's end, where its start is known: past year 9999 is bad input
    except (ScheduleError, OverflowError, ValueError) as exc:
        bad("max_runs", str(exc).replace("max_runs: ", "", 1))
        return None
    return rule


def _maybe(kind: Any, value: Any) -> Any:
    return None if value is None else kind(value)


def build_entry(name: Any, spec: Any, app=None, *, label: str = "beat_schedule entry", check_options: bool = True,
                printable_only: bool = True, origin: Optional[datetime] = None,
                runs_end: Optional[datetime] = None) -> Tuple[Optional[Entry], List[str]]:
    """An :class:`Entry` for one ``beat_schedule`` item, or the list of its problems.

    *label* names where the entry comes from in each problem (stored schedules say so).
    *check_options* False: the caller checked the options already (a stored schedule's pass the
    stricter allow-list of config/options.py first). *printable_only* False: a stored row read back,
    whose name, task and description were valid when written: only what the claim database cannot
    hold is refused (see :func:`~.values.text_problem`); True for text entering (``beat_schedule``).
    *origin*: where ``max_runs`` counts from without ``start_at`` (a stored row's creation; for a
    config entry beat binds its registration when it starts scheduling)."""
    problems: List[str] = []

    def bad(field_name: str, reason: str) -> None:
        problems.append(f"{label} {shown(name, 300)}: {field_name}: {reason}")

    if not isinstance(name, str) or not name:
        return None, [f"{label} {shown(name)}: name: expected a non-empty string"]
    reason = text_problem(name, limit=MAX_NAME_LENGTH, what="a non-empty string", printable_only=printable_only)
    if reason:  # the claim table's key: what it cannot hold exactly must not reach it
        bad("name", reason)
    if not isinstance(spec, (dict, Mapping)):  # a dict first: the ABC check is the slow one
        return None, [f"{label} {shown(name, 300)}: expected a dict with 'task' and 'schedule', "
                      f"got {type(spec).__name__}"]
    ours = False  # any of our own keys: only then are they checked one by one
    for key in spec:
        if key in _CELERY_KEYS:
            continue
        if key in _OUR_KEYS:
            ours = True
        else:
            bad(str(key), f"unknown key (known: {', '.join(CELERY_KEYS + OUR_KEYS + BOUND_KEYS)})")
    task = spec.get("task")
    reason = text_problem(task, limit=MAX_NAME_LENGTH, what="a task name", printable_only=printable_only)
    if reason:
        bad("task", reason)
    schedule = None
    if "schedule" not in spec:
        bad("schedule", "missing")
    else:
        schedule, reason = _check_schedule(spec["schedule"], app)
        if reason:
            bad("schedule", reason)
    args = spec.get("args") or ()
    if not isinstance(args, (list, tuple)):
        bad("args", f"expected a list or tuple, got {type(args).__name__}")
    kwargs = spec.get("kwargs") or {}
    if not isinstance(kwargs, (dict, Mapping)):
        bad("kwargs", f"expected a dict, got {type(kwargs).__name__}")
    elif not all(isinstance(k, str) for k in kwargs):
        bad("kwargs", "keyword names must be strings")
    options = spec.get("options") or {}
    for field_name, reason in option_problems(options) if options and check_options else ():
        bad(field_name, reason)
    enabled, description = True, ""
    if ours:
        for key, kind in (("overlap", OverlapPolicy), ("catchup", CatchupPolicy)):
            value = spec.get(key)
            reason = None if value is None else choice_problem(value, kind)
            if reason:
                bad(key, reason)
        for key, zero_ok in (("max_run_time", False), ("jitter", True), ("catchup_window", False)):
            value = spec.get(key)
            reason = None if value is None else seconds_problem(value, zero_ok=zero_ok)
            if reason:
                bad(key, reason)
        value = spec.get("pause_after_failures")
        reason = None if value is None else count_problem(value, limit=MAX_PAUSE_AFTER_FAILURES)
        if reason:
            bad("pause_after_failures", reason)
        enabled = spec.get("enabled", True)
        if not isinstance(enabled, bool):
            bad("enabled", f"expected True or False, got {shown(enabled)}")
        description = spec.get("description") or ""
        if not printable_only and isinstance(description, str) and len(description.encode("utf-8",
                                                                                         "replace")) > MAX_TEXT_BYTES:
            # Read back, a description written past the API costs its schedule nothing: it is only
            # shown, so it is cut to what the API would have taken, never refused.
            description = description.encode("utf-8", "replace")[:MAX_TEXT_BYTES - 8].decode("utf-8", "ignore") + "…"
        if printable_only:
            reason = description_problem(description) if description else None
        else:
            reason = text_problem(description, limit=MAX_TEXT_BYTES, what="a string", free=True)
        if reason:
            bad("description", reason)
        schedule = _bounds(spec, schedule, origin, bad, runs_end)
    if problems:
        return None, problems
    return (
        Entry(
            name=name,
            task=task,
            schedule=schedule,
            args=tuple(args),
            kwargs=dict(kwargs),
            options=dict(options),
            overlap=_maybe(OverlapPolicy, spec.get("overlap")),
            max_run_time=spec.get("max_run_time"),
            jitter=spec.get("jitter"),
            catchup=_maybe(CatchupPolicy, spec.get("catchup")),
            catchup_window=spec.get("catchup_window"),
            enabled=enabled,
            description=description,
            pause_after_failures=spec.get("pause_after_failures"),
        ),
        [],
    )


def build_entries(beat_schedule: Any, app=None) -> Dict[str, Entry]:
    """Every entry of *beat_schedule*, or one ConfigError listing every problem."""
    if beat_schedule is None:
        return {}
    if not isinstance(beat_schedule, Mapping):
        raise ConfigError(f"beat_schedule: expected a dict of entries, got {type(beat_schedule).__name__}")
    entries: Dict[str, Entry] = {}
    problems: List[str] = []
    for name, spec in beat_schedule.items():
        entry, errors = build_entry(name, spec, app=app)
        problems.extend(errors)
        if entry is not None:
            entries[name] = entry
    if problems:
        raise ConfigError(problems)
    return entries
