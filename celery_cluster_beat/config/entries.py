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
from ..schedules import ClusterSchedule, as_schedule
from .values import CatchupPolicy, OverlapPolicy, choice_problem, seconds_problem

CELERY_KEYS = ("task", "schedule", "args", "kwargs", "options", "relative")
OUR_KEYS = ("overlap", "max_run_time", "jitter", "catchup", "catchup_window", "enabled", "description")


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
    #: Where the entry comes from: None for ``beat_schedule``; for a stored schedule the
    #: version of its definition (the leader's writes about it are conditional on it).
    stored_version: Optional[int] = None
    owner: Optional[str] = None
    # Celery's ScheduleEntry exposes these; tools that read beat's schedule expect them.
    last_run_at: Optional[datetime] = None
    total_run_count: int = 0


def _check_options(options: Any) -> Optional[str]:
    if not isinstance(options, Mapping):
        return f"expected a dict, got {type(options).__name__}"
    headers = options.get("headers")
    if headers is not None and not isinstance(headers, Mapping):
        return f"headers: expected a dict, got {type(headers).__name__}"
    priority = options.get("priority")
    if priority is not None and (isinstance(priority, bool) or not isinstance(priority, int) or not 0 <= priority <= 255):
        return f"priority: expected an integer 0-255, got {priority!r}"
    for key in ("queue", "routing_key"):
        value = options.get(key)
        if value is not None and not isinstance(value, str) and not hasattr(value, "name"):
            return f"{key}: expected a string, got {value!r}"
    return None


_CELERY_KEYS = frozenset(CELERY_KEYS)
_OUR_KEYS = frozenset(OUR_KEYS)


def _maybe(kind: Any, value: Any) -> Any:
    return None if value is None else kind(value)


def build_entry(name: Any, spec: Any, app=None, *, label: str = "beat_schedule entry"
                ) -> Tuple[Optional[Entry], List[str]]:
    """An :class:`Entry` for one ``beat_schedule`` item, or the list of its problems.

    *label* names where the entry comes from in each problem (stored schedules say so)."""
    problems: List[str] = []

    def bad(field_name: str, reason: str) -> None:
        problems.append(f"{label} {name!r}: {field_name}: {reason}")

    if not isinstance(name, str) or not name:
        return None, [f"{label} {name!r}: name: expected a non-empty string"]
    if len(name) > MAX_NAME_LENGTH:
        bad("name", f"longer than {MAX_NAME_LENGTH} characters")
    if not isinstance(spec, (dict, Mapping)):  # a dict first: the ABC check is the slow one
        return None, [f"{label} {name!r}: expected a dict with 'task' and 'schedule', got {type(spec).__name__}"]
    ours = False  # any of our own keys: only then are they checked one by one
    for key in spec:
        if key in _CELERY_KEYS:
            continue
        if key in _OUR_KEYS:
            ours = True
        else:
            bad(str(key), f"unknown key (known: {', '.join(CELERY_KEYS + OUR_KEYS)})")
    task = spec.get("task")
    if not isinstance(task, str) or not task:
        bad("task", f"expected a task name, got {task!r}")
    schedule = None
    if "schedule" not in spec:
        bad("schedule", "missing")
    else:
        try:
            schedule = as_schedule(spec["schedule"], app=app)
        except ScheduleError as exc:
            bad("schedule", str(exc))
    args = spec.get("args") or ()
    if not isinstance(args, (list, tuple)):
        bad("args", f"expected a list or tuple, got {type(args).__name__}")
    kwargs = spec.get("kwargs") or {}
    if not isinstance(kwargs, (dict, Mapping)):
        bad("kwargs", f"expected a dict, got {type(kwargs).__name__}")
    options = spec.get("options") or {}
    reason = _check_options(options) if options else None
    if reason:
        bad("options", reason)
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
        enabled = spec.get("enabled", True)
        if not isinstance(enabled, bool):
            bad("enabled", f"expected True or False, got {enabled!r}")
        description = spec.get("description") or ""
        if not isinstance(description, str):
            bad("description", f"expected a string, got {type(description).__name__}")
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
