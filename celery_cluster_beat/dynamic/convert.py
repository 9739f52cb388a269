"""A stored schedule's row as beat's :class:`Entry`, and the check that a definition can be stored."""
from __future__ import annotations

import json
from typing import Any, Dict, List, Mapping, Optional

from ..config.entries import Entry, build_entry
from ..config.values import CatchupPolicy, OverlapPolicy, choice_problem, seconds_problem
from ..errors import ConfigError, ScheduleError
from ..schedules.text import parse_schedule_text
from ..store.stored import StoredRow

LABEL = "stored schedule"

#: The per-entry keys a stored schedule keeps in columns of their own.
POLICY_KEYS = ("overlap", "max_run_time", "jitter", "catchup", "catchup_window", "description")


def _policy_problem(key: str, value: Any) -> Optional[str]:
    """Why a policy column's value is out of range (the checks of a ``beat_schedule`` entry)."""
    if key in ("overlap", "catchup"):
        return choice_problem(value, OverlapPolicy if key == "overlap" else CatchupPolicy)
    if key in ("max_run_time", "jitter", "catchup_window"):
        return seconds_problem(value, zero_ok=key == "jitter")
    return None


def entry_from_row(row: StoredRow, app: Any = None) -> Entry:
    """The :class:`Entry` a stored row describes; :class:`ConfigError` naming the field when it cannot be.

    A row written past the API (by hand, by another release) whose rule is readable but a policy
    column is out of range (``catchup_window`` infinite, say) still gives an entry, with that column
    left to the global setting and the reason in :attr:`Entry.refused`: beat records each of its
    occurrences ``failed`` with it, so the schedule is seen failing where its runs are looked for,
    instead of vanishing from the schedule or breaking the plan of every schedule due with it.
    """
    problems: List[str] = []
    refused: List[str] = []
    spec: Dict[str, Any] = {"task": row.task}
    try:
        spec["schedule"] = parse_schedule_text(row.schedule, row.zone)
    except ScheduleError as exc:
        problems.append(f"{LABEL} {row.name!r}: schedule: {exc}")
    for key in ("args", "kwargs", "options"):
        try:
            spec[key] = json.loads(getattr(row, key))
        except ValueError as exc:
            problems.append(f"{LABEL} {row.name!r}: {key}: not valid JSON ({exc})")
    for key in POLICY_KEYS:
        value = getattr(row, key)
        if value is not None:
            reason = _policy_problem(key, value)
            if reason:
                refused.append(f"{LABEL} {row.name!r}: {key}: {reason}")
            else:
                spec[key] = value
    spec["enabled"] = row.enabled
    if problems:
        raise ConfigError(problems)
    entry, problems = build_entry(row.name, spec, app=app, label=LABEL)
    if entry is None:
        raise ConfigError(problems)
    entry.stored_version = row.version
    entry.owner = row.owner
    entry.refused = "; ".join(refused) or None
    return entry


def to_json(name: str, key: str, value: Any) -> str:
    """*value* as canonical JSON, or a ConfigError naming the schedule and the field."""
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{LABEL} {name!r}: {key}: not JSON-serialisable ({exc})") from None


def round_trips(name: str, key: str, value: Any, text: str) -> None:
    """Refuse what JSON would silently change (non-string keys): the task would get other
    arguments than the caller gave. Tuples become lists, as in any JSON message."""
    if json.loads(text) != _lists(value):
        raise ConfigError(f"{LABEL} {name!r}: {key}: does not survive JSON unchanged (use lists, dicts with "
                          "string keys, strings, numbers, booleans and None)")


def _lists(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _lists(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_lists(v) for v in value]
    return value
