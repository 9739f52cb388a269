"""A stored schedule's row as beat's :class:`Entry`, and the check that a definition can be stored.

A stored schedule's author is not trusted the way the Celery config is: its options pass the
allow-list of :mod:`..config.options`, and its JSON is bounded in size and nesting (a megabyte of
arguments, or ten thousand nested lists that make ``json`` raise ``RecursionError``, must cost one
refusal, never beat's loop). The API refuses such a definition; a row written past the API has the
same checks applied when beat reads it, and its occurrences are recorded ``failed`` with the reason.
"""
from __future__ import annotations

import json
import weakref
from collections.abc import Mapping
from typing import Any, Collection, Dict, List, Optional, Tuple

from ..config.entries import BOUND_KEYS, MAX_PAUSE_AFTER_FAILURES, Entry, build_entry
from ..config.options import conf_allowed_stored_options, stored_option_problems
from ..config.values import (MAX_TEXT_BYTES, CatchupPolicy, OverlapPolicy, choice_problem, count_problem,
                             seconds_problem)
from ..errors import ConfigError, ScheduleError
from ..schedules.celery_types import ClusterSchedule, as_schedule, bounded
from ..schedules.text import parse_schedule_text
from ..store.stored import StoredRow

LABEL = "stored schedule"

#: Deepest nesting of lists and dicts in a stored schedule's args, kwargs and options (the value
#: itself is level 1): deep enough for any real document, far below what ``json`` recurses through.
MAX_JSON_DEPTH = 32
_SCALARS = frozenset({str, int, float, bool, type(None)})
#: The allow-list setting of each app beat converts rows for (:func:`_allowed`).
_ALLOWED: "weakref.WeakKeyDictionary[Any, Collection[str]]" = weakref.WeakKeyDictionary()
#: What a JSON column holds when it is read back: args a list, kwargs and options a dict.
_JSON_EMPTY: Dict[str, Any] = {"args": [], "kwargs": {}, "options": {}}

#: The per-entry keys a stored schedule keeps in columns of their own.
POLICY_KEYS = ("overlap", "max_run_time", "jitter", "catchup", "catchup_window", "description",
               "pause_after_failures")


def _policy_problem(key: str, value: Any) -> Optional[str]:
    """Why a policy column's value is out of range (the checks of a ``beat_schedule`` entry)."""
    if key in ("overlap", "catchup"):
        return choice_problem(value, OverlapPolicy if key == "overlap" else CatchupPolicy)
    if key in ("max_run_time", "jitter", "catchup_window"):
        return seconds_problem(value, zero_ok=key == "jitter")
    if key == "pause_after_failures":
        return count_problem(value, limit=MAX_PAUSE_AFTER_FAILURES)
    return None


def entry_from_row(row: StoredRow, app: Any = None, *, allowed: Optional[Collection[str]] = None) -> Entry:
    """The :class:`Entry` a stored row describes; :class:`ConfigError` naming the field when it cannot be.

    A row written past the API (by hand, by another release) whose rule is readable but a policy
    column is out of range (``catchup_window`` infinite, say), an option outside the allow-list
    (``options.headers.task``), or JSON too big or too deep still gives an entry, with that value
    left out (a column left to the global setting, only the allowed options kept) and the reason
    in :attr:`Entry.refused`: beat records each of its occurrences ``failed`` with it, so the
    schedule is seen failing where its runs are looked for, instead of vanishing from the schedule,
    breaking the plan of every schedule due with it, or being sent with what it may not ask for.

    *allowed*: the options the application allows beyond the default list (None: read
    ``cluster_beat_stored_options_allowed`` from *app*'s config).
    """
    problems: List[str] = []
    refused: List[Tuple[str, str]] = []  # (column, reason)
    spec: Dict[str, Any] = {"task": row.task}
    try:
        spec["schedule"] = parse_schedule_text(row.schedule, row.zone)
    except ScheduleError as exc:
        problems.append(f"{LABEL} {row.name!r}: schedule: {exc}")
    for key in ("args", "kwargs", "options"):
        text = getattr(row, key)
        if isinstance(text, str) and len(text.encode("utf-8")) > MAX_TEXT_BYTES:
            refused.append((key, f"{LABEL} {row.name!r}: {key}: more than {MAX_TEXT_BYTES} bytes as JSON"))
            spec[key] = _JSON_EMPTY[key]
            continue
        try:
            spec[key] = json.loads(text)
        except (ValueError, TypeError, RecursionError) as exc:  # RecursionError: nested past json's reach
            problems.append(f"{LABEL} {row.name!r}: {key}: not valid JSON ({exc.__class__.__name__}: "
                            f"{str(exc)[:200]})")
            continue
        # More brackets than levels allowed (brackets in strings count too) is the rare case: walk it.
        reason = json_depth_problem(spec[key]) if text.count("[") + text.count("{") > MAX_JSON_DEPTH else None
        if reason:
            refused.append((key, f"{LABEL} {row.name!r}: {key}: {reason}"))
            spec[key] = _JSON_EMPTY[key]
    if "options" in spec:
        if allowed is None:
            allowed = _allowed(app)
        spec["options"], bad = stored_option_problems(spec["options"], allowed)
        refused.extend(("options", f"{LABEL} {row.name!r}: {field}: {reason}") for field, reason in bad)
    for key in POLICY_KEYS:
        value = getattr(row, key)
        if value is not None:
            reason = _policy_problem(key, value)
            if reason:
                refused.append((key, f"{LABEL} {row.name!r}: {key}: {reason}"))
            else:
                spec[key] = value
    spec["enabled"] = row.enabled
    for key in BOUND_KEYS:
        if getattr(row, key) is not None:
            spec[key] = getattr(row, key)
    runs_end_at = getattr(row, "runs_end_at", None)
    if row.max_runs is not None and row.created_at is not None and runs_end_at is None:
        # The API stores where the count ends when it writes the row; the leader never walks it. A row
        # written past the API without it is refused: its occurrences are recorded failed, saying why.
        refused.append(("max_runs", f"{LABEL} {row.name!r}: max_runs: runs_end_at is not set (the end of its "
                                    "count, computed when the API writes the row): store it through the API"))
        spec.pop("max_runs", None)
    if problems:
        raise ConfigError(problems)
    entry, problems = build_entry(row.name, spec, app=app, label=LABEL, check_options="options" not in spec,
                                  printable_only=False,  # valid when written: readable, shown escaped
                                  origin=row.created_at,  # max_runs without start_at counts from the creation
                                  runs_end=runs_end_at)  # ... and ends where the API found (no walk here)
    if entry is None:
        raise ConfigError(problems)
    entry.stored_version = row.version
    entry.owner = row.owner
    entry.refused = "; ".join(reason for _, reason in refused) or None
    entry.refusals = tuple(refused)
    return entry


def rule_of_row(row: Mapping[str, Any], app: Any = None) -> ClusterSchedule:
    """The rule a row's definition columns give (its bounds included, counted from its ``created_at``),
    without the rest of :func:`entry_from_row`'s checks: where a change computes the next occurrence."""
    rule = as_schedule(parse_schedule_text(row["schedule"], row["zone"]), app=app)
    if all(row.get(key) is None for key in BOUND_KEYS):
        return rule
    return bounded(rule, start_at=row.get("start_at"), end_at=row.get("end_at"), max_runs=row.get("max_runs"),
                   origin=row.get("created_at"), runs_end=row.get("runs_end_at"))


def _allowed(app: Any) -> Collection[str]:
    """``cluster_beat_stored_options_allowed`` of *app*, read once per app (settings are read at
    start-up; beat converts every stored row it loads)."""
    if app is None:
        return ()
    try:
        return _ALLOWED[app]
    except (KeyError, TypeError):
        allowed = conf_allowed_stored_options(app.conf)
        try:
            _ALLOWED[app] = allowed
        except TypeError:  # not weakly referable: read each time
            pass
        return allowed


def json_depth_problem(value: Any) -> Optional[str]:
    """Why *value* (JSON data) is nested too deep to store; None when it is not. Iterative and
    bounded by :data:`MAX_JSON_DEPTH` levels, so a value that contains itself is refused too."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        kind = type(item)
        if kind in _SCALARS:
            continue
        if kind is dict or isinstance(item, Mapping):
            children: Any = item.values()
        elif kind is list or isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            return f"nested deeper than {MAX_JSON_DEPTH} levels of lists and dicts"
        stack.extend((child, depth + 1) for child in children)
    return None


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
