"""The application's API for schedules made at run time.

::

    from celery_cluster_beat import cron
    from celery_cluster_beat.dynamic import StoredSchedules

    schedules = StoredSchedules(app)
    schedules.add("report:42", "reports.run_report", cron("0 9 * * 1-5", tz="Europe/Paris"),
                  args=[42], owner="alice")
    schedules.update("report:42", schedule="30 8 * * 1-5")
    schedules.disable("report:42"); schedules.enable("report:42")
    schedules.remove("report:42")

Each call is one transaction in the claim database (the same one beat uses,
from ``cluster_beat_db_url``) that bumps the change counter; when the cluster
has a Redis lease, a notice on Redis tells the leader at once. The leader
applies the change within a second, without a restart and without reading the
other schedules.

Rules a change follows:

* Validation is that of ``beat_schedule`` entries (same fields, same messages),
  plus: arguments, keyword arguments and options must be JSON (at most 65,535
  bytes, 32 levels deep), options must pass the allow-list of
  :mod:`..config.options` (nothing that changes which task runs, its id or its
  serializer, unless ``cluster_beat_stored_options_allowed`` names it), and a name
  must not be one of the Celery config's ``beat_schedule`` entries. New text (a name,
  task, owner or description) must be printable; a description may run over lines.
* An update checks only the fields it is given: the others keep their stored values as
  they are, so a row stored by an older release (or past the API) with a value now
  refused can still be disabled, enabled, changed or removed; beat records its
  occurrences ``failed`` with the reason until the value is replaced.
* A changed schedule's next occurrence is computed from the change's time (the
  database's clock), not from its previous occurrence.
* A disabled schedule records nothing while disabled; enabling it again starts
  from that moment: it does not catch up to the time it was disabled.
* A removed schedule never fires again; its past occurrences stay in the
  claim table as history until pruned.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from ..config.celeryconf import default_entries
from ..config.observing import configuration_problems
from ..base import MAX_NAME_LENGTH
from ..config.settings import Settings, load_settings
from ..config.values import MAX_TEXT_BYTES, description_problem, shown, text_problem
from ..errors import ConfigError, ScheduleError, UnknownSchedule
from ..schedules.bounds import runs_end, runs_problem
from ..schedules.celery_types import app_zone
from ..schedules.instants import utcnow
from ..schedules.rules import parse_instant
from ..schedules.tzwall import get_zone, zone_name
from ..schedules.text import parse_schedule_text, schedule_text
from ..store import ClaimStore
from ..store.stored import DEFINITION, StoredRow
from .convert import LABEL, POLICY_KEYS, entry_from_row, json_depth_problem, round_trips, rule_of_row, to_json

#: Bounds on when a stored schedule fires (schedules/bounds.py), each a column of its own.
BOUND_FIELDS = ("start_at", "end_at", "max_runs")
#: What :meth:`StoredSchedules.update` may change.
FIELDS = ("task", "schedule", "args", "kwargs", "options", *POLICY_KEYS, "owner", "enabled", *BOUND_FIELDS)
#: ... and the zone of its rule (``tz``), which otherwise stays what it was.
UPDATE_FIELDS = (*FIELDS, "tz")
#: Width of the zone column (schema: ``zone``).
MAX_ZONE_LENGTH = 64


def _name_problem(name: Any, *, new: bool = False) -> Optional[str]:
    """Why *name* cannot be a stored schedule's name (it keys the claim table); None when it can.
    A *new* one (add) must be printable text; one looked up (get, update, remove) need only be
    storable: a name stored before the printable rule stays reachable, to change or remove it."""
    reason = text_problem(name, limit=MAX_NAME_LENGTH, what="a non-empty string", printable_only=new)
    return f"{LABEL} {shown(name, 300)}: name: {reason}" if reason else None


def _schedule_text(name: str, value: Any) -> Tuple[str, Optional[str]]:
    """``(text, zone)`` of a schedule given to the API; ConfigError naming the field when it is bad
    (a number too big for an interval included: bad input, never another exception)."""
    try:
        return schedule_text(value)
    except ScheduleError as exc:
        raise ConfigError(f"{LABEL} {name!r}: schedule: {exc}") from None
    except (OverflowError, ValueError, TypeError, ArithmeticError) as exc:
        raise ConfigError(f"{LABEL} {name!r}: schedule: cannot be read as a schedule "
                          f"({exc.__class__.__name__}: {exc})") from None


def _bound(name: str, key: str, value: Any) -> Any:
    """A bound given to the API as its column holds it (aware UTC, or a count); ConfigError when bad."""
    if value is None:
        return None
    if key == "max_runs":
        reason = runs_problem(value)
        if reason:
            raise ConfigError(f"{LABEL} {name!r}: max_runs: {reason}")
        return value
    try:
        return parse_instant(value, "")
    except ScheduleError as exc:
        raise ConfigError(f"{LABEL} {name!r}: {key}: {exc}") from None


def _zone_of(name: str, tz: Any) -> Optional[str]:
    """The zone name *tz* (a name, a zone with a key, or None: the app's); ConfigError when unknown."""
    if tz is None:
        return None
    key = tz if isinstance(tz, str) else getattr(tz, "key", None)
    if not isinstance(key, str) or len(key) > MAX_ZONE_LENGTH:
        raise ConfigError(f"{LABEL} {name!r}: tz: expected an IANA zone name, got {shown(tz)}")
    try:
        get_zone(key)
    except ScheduleError as exc:
        raise ConfigError(f"{LABEL} {name!r}: tz: {exc}") from None
    return key


@dataclass(frozen=True)
class StoredSchedule:
    """A stored schedule as the application reads it back (arguments decoded from JSON)."""

    name: str
    task: str
    schedule: str  #: cron fields, or "every <seconds>s [from HH:MM]"
    zone: Optional[str]
    args: List[Any]
    kwargs: Dict[str, Any]
    options: Dict[str, Any]
    overlap: Optional[str]
    max_run_time: Optional[float]
    jitter: Optional[float]
    catchup: Optional[str]
    catchup_window: Optional[float]
    description: str
    owner: Optional[str]
    enabled: bool
    version: int
    created_at: datetime
    changed_at: datetime
    #: The next occurrence as last recorded; the leader keeps the exact value of schedules
    #: due soon in memory, so for those this may lag. None once it has ended (or while disabled).
    next_at: Optional[datetime]
    #: Pause after this many consecutive failed runs (None: never).
    pause_after_failures: Optional[int] = None
    #: Bounds (aware UTC; None: unbounded). max_runs counts from start_at, else created_at.
    start_at: Optional[datetime] = None
    end_at: Optional[datetime] = None
    max_runs: Optional[int] = None
    #: When its rule was found to have no further occurrence (a one-off that fired, a bound passed):
    #: it never fires again and stays, as history, until removed.
    ended_at: Optional[datetime] = None

    @classmethod
    def from_row(cls, row: StoredRow) -> "StoredSchedule":
        import json

        return cls(
            name=row.name, task=row.task, schedule=row.schedule, zone=row.zone, args=json.loads(row.args),
            kwargs=json.loads(row.kwargs), options=json.loads(row.options), overlap=row.overlap,
            max_run_time=row.max_run_time, jitter=row.jitter, catchup=row.catchup,
            catchup_window=row.catchup_window, description=row.description or "", owner=row.owner,
            enabled=row.enabled, version=row.version, created_at=row.created_at, changed_at=row.changed_at,
            next_at=row.next_at, pause_after_failures=row.pause_after_failures, start_at=row.start_at,
            end_at=row.end_at, max_runs=row.max_runs, ended_at=row.ended_at,
        )


class StoredSchedules:
    """Add, change, enable, disable and remove stored schedules of one Celery app's cluster.

    Thread-safe (each call is its own transaction); open lazily, so building one
    touches neither the database nor Redis. :meth:`close` releases both.
    """

    def __init__(self, app: Any, *, db_url: Optional[str] = None) -> None:
        self.app = app
        self.settings: Settings = load_settings(app.conf, has_result_backend=lambda: False, app_name=app.main)
        url = db_url or self.settings.db_url
        node = f"api:{socket.gethostname()}:{os.getpid()}"
        self._store = ClaimStore(url, node_id=node[:255], db_timeout=self.settings.db_timeout)
        self._notices: Any = None
        self._opened = False

    # -- plumbing -----------------------------------------------------------------
    def _open(self) -> ClaimStore:
        if not self._opened:
            self._store.open()
            self._opened = True
        return self._store

    @property
    def store(self) -> ClaimStore:
        """The claim store the schedules live in (opened on first use)."""
        return self._open()

    def _static_names(self) -> set:
        beat_schedule = self.app.conf.beat_schedule or {}
        names = set(beat_schedule)
        names.update(default_entries(self.app, beat_schedule))
        return names

    def _notify(self, version: int) -> None:
        if self.settings.redis is None:
            return
        if self._notices is None:
            from ..leader.notices import ChangeNotices

            self._notices = ChangeNotices(self.settings.redis.client, self.settings.cluster_name)
        self._notices.publish(version)

    def _next_fire(self, row: Dict[str, Any], now: datetime) -> Optional[datetime]:
        """A written row's next occurrence after *now* (database clock); sets its ``runs_end_at`` (no leader walks)."""
        if row.get("max_runs") is not None:
            start = row.get("start_at") or row["created_at"]
            try:
                rule = parse_schedule_text(row["schedule"], row["zone"])
                row["runs_end_at"] = runs_end(rule, start, row["max_runs"], row.get("end_at"))
            except ScheduleError as exc:
                raise ConfigError(f"{LABEL} {row['name']!r}: max_runs: {str(exc).replace('max_runs: ', '', 1)}") from None
        if not row["enabled"]:
            return None
        return rule_of_row(row, app=self.app).next_fire(now)

    def _definition(self, name: str, values: Mapping[str, Any], old: Optional[StoredRow] = None) -> Dict[str, Any]:
        """A row's definition columns from API values, validated like a beat_schedule entry.

        *old*: the row an update changes. A field *values* lacks keeps the row's stored value as it
        is, not checked again: a row a release accepted, or one written past the API, can still be
        disabled, enabled or given another field; what beat may not send of it, beat refuses when it
        sends (:attr:`~..config.Entry.refused`). New text (name, task, owner, description) must be
        printable (a description may run over lines)."""
        problem = _name_problem(name, new=old is None)
        if problem:
            raise ConfigError(problem)
        if name in self._static_names():
            raise ConfigError(f"{LABEL} {name!r}: name: the Celery config's beat_schedule has an entry "
                              f"{name!r} already; stored and configured schedules share one namespace")
        unknown = sorted(set(values) - set(FIELDS))
        if unknown:
            raise ConfigError(f"{LABEL} {name!r}: {unknown[0]}: unknown field (known: {', '.join(FIELDS)})")
        given = set(FIELDS) if old is None else set(values)
        row: Dict[str, Any] = {"name": name}
        for key in DEFINITION:  # what an update does not give stays as stored
            if old is not None and key not in given and key != "name":
                row[key] = getattr(old, key)
        if "schedule" in given:
            row["schedule"], row["zone"] = _schedule_text(name, values["schedule"])
            if row["zone"] is not None and len(row["zone"]) > MAX_ZONE_LENGTH:
                raise ConfigError(f"{LABEL} {name!r}: schedule: zone name longer than {MAX_ZONE_LENGTH} characters")
            exact = row["schedule"].startswith("every") and " from " not in row["schedule"] or (
                row["schedule"].startswith("at ") and row["schedule"].endswith("Z"))  # no wall time to read
            if row["zone"] is None and not exact:
                # A wall-clock rule without a zone of its own is stored in the app's zone, so the leader
                # reads it in the zone it was written for, whatever its own timezone setting says.
                row["zone"] = zone_name(app_zone(self.app))
        for key, empty in (("args", []), ("kwargs", {}), ("options", {})):
            if key not in given:
                continue
            value = values.get(key)
            value = empty if value is None else value
            if key == "args" and not isinstance(value, (list, tuple)):
                raise ConfigError(f"{LABEL} {name!r}: args: expected a list or tuple, got {type(value).__name__}")
            if key != "args" and not isinstance(value, Mapping):
                raise ConfigError(f"{LABEL} {name!r}: {key}: expected a dict, got {type(value).__name__}")
            reason = json_depth_problem(value)  # before json: it raises RecursionError past ~1,000 levels
            if reason:
                raise ConfigError(f"{LABEL} {name!r}: {key}: {reason}")
            text = to_json(name, key, value)
            round_trips(name, key, value, text)
            if len(text) > MAX_TEXT_BYTES:  # JSON here is ASCII: characters are bytes
                raise ConfigError(f"{LABEL} {name!r}: {key}: {len(text)} bytes as JSON, more than the "
                                  f"{MAX_TEXT_BYTES} the claim database keeps")
            row[key] = text
        if "task" in given:
            row["task"] = values.get("task")
            reason = text_problem(row["task"], limit=MAX_NAME_LENGTH, what="a task name")
            if reason and isinstance(row["task"], str):  # (not a string: build_entry says so, as for an entry)
                raise ConfigError(f"{LABEL} {name!r}: task: {reason}")
        for key in POLICY_KEYS:
            if key in given:
                value = values.get(key)
                row[key] = getattr(value, "value", value)  # an enum member is stored as its text
        if "description" in given:
            description = row["description"]
            if description is not None and not isinstance(description, str):  # not "" for a 0 or a False
                raise ConfigError(f"{LABEL} {name!r}: description: expected a string, got {shown(description)}")
            reason = description_problem(description) if description else None
            if reason:
                raise ConfigError(f"{LABEL} {name!r}: description: {reason}")
            row["description"] = description or None
        if "owner" in given:
            owner = values.get("owner")
            reason = None if owner is None else text_problem(owner, limit=MAX_NAME_LENGTH, what="a string")
            if reason:
                raise ConfigError(f"{LABEL} {name!r}: owner: expected a string of at most {MAX_NAME_LENGTH} "
                                  f"characters: {reason}")
            row["owner"] = owner
        if "enabled" in given:
            row["enabled"] = values.get("enabled", True)
        for key in BOUND_FIELDS:
            if key in given:
                row[key] = _bound(name, key, values.get(key))
        # The exact checks (and messages) of a beat_schedule entry, on what would be stored.
        entry = entry_from_row(StoredRow(**{k: row[k] for k in DEFINITION}, deleted=False, version=0,
                                         created_at=None, changed_at=None, next_at=None),  # type: ignore[arg-type]
                               app=self.app, allowed=self.settings.stored_options_allowed)
        refused = [reason for column, reason in entry.refusals if column in given]
        if refused:  # read back from a row, such a value is left to the setting; here it is refused
            raise ConfigError("; ".join(refused))
        problems = configuration_problems(self.app, self.settings, [entry], label=LABEL)
        if problems:  # an explicit guard on runs nothing can observe would block it silently
            raise ConfigError(problems)
        if old is None:
            self._open().check_names([name])
        return row

    def _next_fire_new(self, row: Dict[str, Any], now: datetime) -> Optional[datetime]:
        """:meth:`_next_fire` of a new row: none left after the database's *now* is refused."""
        nxt = self._next_fire(row, now)
        if nxt is None and row["enabled"]:
            self._never_fires(row["name"], row, now)
        return nxt

    def _never_fires(self, name: str, row: Mapping[str, Any], now: Optional[datetime] = None) -> None:
        """Refuse to add a schedule that has no occurrence left after *now* (a one-off in the past, an
        end_at that passed): stored, it would end at once without a trace of why. An update may end a
        schedule (end_at now, say): it is then marked ended."""
        if now is None:  # a dry run (validate): this host's clock; add decides by the database's
            now = utcnow()
            try:
                if not row.get("enabled", True) or rule_of_row(dict(row, created_at=now), app=self.app).next_fire(now):
                    return
            except ScheduleError as exc:
                raise ConfigError(f"{LABEL} {name!r}: max_runs: {str(exc).replace('max_runs: ', '', 1)}") from None
        if row.get("end_at") is not None and row["end_at"] <= now:
            raise ConfigError(f"{LABEL} {name!r}: end_at: {row['end_at'].isoformat()} has passed: the schedule "
                              "would never fire")
        field = "schedule" if row["schedule"].startswith("at ") else "start_at" if row.get("start_at") else "schedule"
        raise ConfigError(f"{LABEL} {name!r}: {field}: no occurrence after now ({now.isoformat()}): the schedule "
                          "would never fire")

    def _change(self, names: Sequence[str], change: Any, new: bool = False) -> int:
        version = self._open().stored_change(names, change, self._next_fire_new if new else self._next_fire)
        self._notify(version)
        return version

    def _read(self, name: str) -> StoredSchedule:
        rows = self._open().stored_get([name])
        if not rows:
            raise UnknownSchedule(name)
        return StoredSchedule.from_row(rows[0])

    # -- the API --------------------------------------------------------------------
    def add(self, name: str, task: str, schedule: Any, *, args: Sequence[Any] = (),
            kwargs: Optional[Mapping[str, Any]] = None, options: Optional[Mapping[str, Any]] = None,
            overlap: Optional[str] = None, max_run_time: Optional[float] = None, jitter: Optional[float] = None,
            catchup: Optional[str] = None, catchup_window: Optional[float] = None, description: str = "",
            owner: Optional[str] = None, enabled: bool = True, start_at: Optional[Any] = None,
            end_at: Optional[Any] = None, max_runs: Optional[int] = None,
            pause_after_failures: Optional[int] = None) -> StoredSchedule:
        """Store a new schedule; :class:`ConfigError` if the name is taken or a field is bad.

        *schedule* may be ``at(when)``: it fires once, then the row stays, ended, as history.
        *start_at* / *end_at* (aware datetimes or ISO-8601 text with an offset) and *max_runs* bound
        any schedule; max_runs counts the occurrences from start_at (else from the row's creation),
        whatever became of them (sent, skipped, missed or failed). *pause_after_failures* pauses it
        after that many consecutive failed runs."""
        values = dict(task=task, schedule=schedule, args=args, kwargs=kwargs, options=options, overlap=overlap,
                      max_run_time=max_run_time, jitter=jitter, catchup=catchup, catchup_window=catchup_window,
                      description=description, owner=owner, enabled=enabled, start_at=start_at, end_at=end_at,
                      max_runs=max_runs, pause_after_failures=pause_after_failures)
        row = self._definition(name, values)

        def change(live: Dict[str, StoredRow], now: datetime) -> Tuple[List[Dict[str, Any]], List[str]]:
            if name in live:
                raise ConfigError(f"{LABEL} {name!r}: name: a stored schedule of that name exists already "
                                  "(update() changes it)")
            return [row], []

        self._change([name], change, new=True)
        return self._read(name)

    def add_many(self, specs: Iterable[Mapping[str, Any]]) -> int:
        """Store many new schedules in one transaction (one version); each spec has add()'s
        parameters as keys (``name``, ``task``, ``schedule`` ...). Returns how many."""
        rows = []
        for spec in specs:
            spec = dict(spec)
            name = spec.pop("name", None)
            rows.append(self._definition(name, spec))
        names = [r["name"] for r in rows]
        if len(set(names)) != len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise ConfigError(f"{LABEL} {dup!r}: name: given twice")

        def change(live: Dict[str, StoredRow], now: datetime) -> Tuple[List[Dict[str, Any]], List[str]]:
            if live:
                taken = sorted(live)[0]
                raise ConfigError(f"{LABEL} {taken!r}: name: a stored schedule of that name exists already")
            return rows, []

        self._change(names, change, new=True)
        return len(rows)

    def validate(self, spec: Mapping[str, Any]) -> None:
        """Check one :meth:`add_many` spec as :meth:`add_many` would (every check, the same
        :class:`ConfigError`), writing nothing: a dry run's answer to "would this be stored?"."""
        spec = dict(spec)
        name = spec.pop("name", None)
        self._never_fires(name, self._definition(name, spec))

    def update(self, name: str, **fields: Any) -> StoredSchedule:
        """Change the given fields of a stored schedule; the rest stay. Its next occurrence is
        computed from now. :class:`UnknownSchedule` when there is none of that name.

        The zone stays too: a new rule without a zone of its own (``"30 8 * * 1-5"``) is read in
        the schedule's zone, not the app's. ``tz="Europe/Paris"`` changes the zone (with or without
        a new rule); ``tz=None`` makes it follow the app's ``timezone`` setting at the time of the change."""
        problem = _name_problem(name)
        if problem:
            raise ConfigError(problem)
        unknown = sorted(set(fields) - set(UPDATE_FIELDS))
        if unknown:
            raise ConfigError(f"{LABEL} {name!r}: {unknown[0]}: unknown field (known: {', '.join(UPDATE_FIELDS)})")
        given = dict(fields)
        zone_given = "tz" in given
        tz = _zone_of(name, given.pop("tz", None))
        if "schedule" in given:  # validate the new fields before taking any lock
            _schedule_text(name, given["schedule"])

        def change(live: Dict[str, StoredRow], now: datetime) -> Tuple[List[Dict[str, Any]], List[str]]:
            if name not in live:
                raise UnknownSchedule(name)
            old = live[name]
            new = dict(given)
            if "schedule" in new or zone_given:
                rule = new["schedule"] if "schedule" in new else parse_schedule_text(old.schedule, old.zone)
                text, zone = _schedule_text(name, rule)
                if zone_given:
                    zone = tz
                elif zone is None:  # a rule without a zone of its own keeps the schedule's zone
                    zone = old.zone
                new["schedule"] = parse_schedule_text(text, zone)
            return [self._definition(name, new, old)], []

        self._change([name], change)
        return self._read(name)

    def enable(self, name: str) -> StoredSchedule:
        """Enable a schedule; it fires from now on, without catching up to when it was disabled."""
        return self.update(name, enabled=True)

    def disable(self, name: str) -> StoredSchedule:
        """Disable a schedule: nothing is sent or recorded for it until enabled again."""
        return self.update(name, enabled=False)

    def remove(self, name: str) -> bool:
        """Remove a stored schedule; False when there was none of that name."""
        if _name_problem(name):
            return False
        removed: List[bool] = []

        def change(live: Dict[str, StoredRow], now: datetime) -> Tuple[List[Dict[str, Any]], List[str]]:
            removed.append(name in live)
            return [], [name]

        self._change([name], change)
        return removed[0]

    def get(self, name: str) -> Optional[StoredSchedule]:
        """The stored schedule *name*, or None."""
        if _name_problem(name):  # no schedule can have it: the database is not asked
            return None
        try:
            return self._read(name)
        except UnknownSchedule:
            return None

    def list(self, owner: Optional[str] = None) -> List[StoredSchedule]:
        """Every stored schedule (of *owner*, if given), by name."""
        return [StoredSchedule.from_row(r) for r in self._open().stored_list(owner=owner)]

    def close(self) -> None:
        if self._notices is not None:
            self._notices.close()
            self._notices = None
        self._store.close()
        self._opened = False

    def __enter__(self) -> "StoredSchedules":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
