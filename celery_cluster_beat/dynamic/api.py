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
  plus: arguments, keyword arguments and options must be JSON, and a name must
  not be one of the Celery config's ``beat_schedule`` entries.
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
from ..config.settings import Settings, load_settings
from ..errors import ConfigError, ScheduleError, UnknownSchedule
from ..schedules.celery_types import app_zone, as_schedule
from ..schedules.tzwall import zone_name
from ..schedules.text import parse_schedule_text, schedule_text
from ..store import ClaimStore
from ..store.stored import DEFINITION, StoredRow
from .convert import LABEL, POLICY_KEYS, entry_from_row, round_trips, to_json

#: What :meth:`StoredSchedules.update` may change.
FIELDS = ("task", "schedule", "args", "kwargs", "options", *POLICY_KEYS, "owner", "enabled")


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
    #: due soon in memory, so for those this may lag.
    next_at: Optional[datetime]

    @classmethod
    def from_row(cls, row: StoredRow) -> "StoredSchedule":
        import json

        return cls(
            name=row.name, task=row.task, schedule=row.schedule, zone=row.zone, args=json.loads(row.args),
            kwargs=json.loads(row.kwargs), options=json.loads(row.options), overlap=row.overlap,
            max_run_time=row.max_run_time, jitter=row.jitter, catchup=row.catchup,
            catchup_window=row.catchup_window, description=row.description or "", owner=row.owner,
            enabled=row.enabled, version=row.version, created_at=row.created_at, changed_at=row.changed_at,
            next_at=row.next_at,
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
        self._store = ClaimStore(url, node_id=node[:255])
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

    def _next_fire(self, row: Mapping[str, Any], now: datetime) -> Optional[datetime]:
        if not row["enabled"]:
            return None
        return as_schedule(parse_schedule_text(row["schedule"], row["zone"]), app=self.app).next_fire(now)

    def _definition(self, name: str, values: Mapping[str, Any]) -> Dict[str, Any]:
        """A row's definition columns from API values, validated like a beat_schedule entry."""
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{LABEL} {name!r}: name: expected a non-empty string")
        if name in self._static_names():
            raise ConfigError(f"{LABEL} {name!r}: name: the Celery config's beat_schedule has an entry "
                              f"{name!r} already; stored and configured schedules share one namespace")
        unknown = sorted(set(values) - set(FIELDS))
        if unknown:
            raise ConfigError(f"{LABEL} {name!r}: {unknown[0]}: unknown field (known: {', '.join(FIELDS)})")
        row: Dict[str, Any] = {"name": name}
        try:
            row["schedule"], row["zone"] = schedule_text(values["schedule"])
        except ScheduleError as exc:
            raise ConfigError(f"{LABEL} {name!r}: schedule: {exc}") from None
        if row["zone"] is None and (not row["schedule"].startswith("every") or " from " in row["schedule"]):
            # A wall-clock rule without a zone of its own is stored in the app's zone, so the leader
            # reads it in the zone it was written for, whatever its own timezone setting says.
            row["zone"] = zone_name(app_zone(self.app))
        for key, empty in (("args", []), ("kwargs", {}), ("options", {})):
            value = values.get(key)
            value = empty if value is None else value
            if key == "args" and not isinstance(value, (list, tuple)):
                raise ConfigError(f"{LABEL} {name!r}: args: expected a list or tuple, got {type(value).__name__}")
            if key != "args" and not isinstance(value, Mapping):
                raise ConfigError(f"{LABEL} {name!r}: {key}: expected a dict, got {type(value).__name__}")
            text = to_json(name, key, value)
            round_trips(name, key, value, text)
            row[key] = text
        row["task"] = values.get("task")
        for key in POLICY_KEYS:
            value = values.get(key)
            row[key] = getattr(value, "value", value)  # an enum member is stored as its text
        row["description"] = row["description"] or None
        owner = values.get("owner")
        if owner is not None and (not isinstance(owner, str) or len(owner) > 255):
            raise ConfigError(f"{LABEL} {name!r}: owner: expected a string of at most 255 characters, got {owner!r}")
        row["owner"] = owner
        row["enabled"] = values.get("enabled", True)
        # The exact checks (and messages) of a beat_schedule entry, on what would be stored.
        entry = entry_from_row(StoredRow(**{k: row[k] for k in DEFINITION}, deleted=False, version=0,
                                         created_at=None, changed_at=None, next_at=None),  # type: ignore[arg-type]
                               app=self.app)
        problems = configuration_problems(self.app, self.settings, [entry], label=LABEL)
        if problems:  # an explicit guard on runs nothing can observe would block it silently
            raise ConfigError(problems)
        self._open().check_names([name])
        return row

    @staticmethod
    def _values(row: StoredRow) -> Dict[str, Any]:
        """API values of an existing row (for a partial update)."""
        s = StoredSchedule.from_row(row)
        from ..schedules.text import parse_schedule_text as parse

        values = {k: getattr(s, k) for k in FIELDS if k != "schedule"}
        values["schedule"] = parse(row.schedule, row.zone)
        return values

    def _change(self, names: Sequence[str], change: Any) -> int:
        version = self._open().stored_change(names, change, self._next_fire)
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
            owner: Optional[str] = None, enabled: bool = True) -> StoredSchedule:
        """Store a new schedule; :class:`ConfigError` if the name is taken or a field is bad."""
        values = dict(task=task, schedule=schedule, args=args, kwargs=kwargs, options=options, overlap=overlap,
                      max_run_time=max_run_time, jitter=jitter, catchup=catchup, catchup_window=catchup_window,
                      description=description, owner=owner, enabled=enabled)
        row = self._definition(name, values)

        def change(live: Dict[str, StoredRow], now: datetime) -> Tuple[List[Dict[str, Any]], List[str]]:
            if name in live:
                raise ConfigError(f"{LABEL} {name!r}: name: a stored schedule of that name exists already "
                                  "(update() changes it)")
            return [row], []

        self._change([name], change)
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

        self._change(names, change)
        return len(rows)

    def update(self, name: str, **fields: Any) -> StoredSchedule:
        """Change the given fields of a stored schedule; the rest stay. Its next occurrence is
        computed from now. :class:`UnknownSchedule` when there is none of that name."""
        unknown = sorted(set(fields) - set(FIELDS))
        if unknown:
            raise ConfigError(f"{LABEL} {name!r}: {unknown[0]}: unknown field (known: {', '.join(FIELDS)})")
        if "schedule" in fields:  # validate the new fields before taking any lock
            try:
                schedule_text(fields["schedule"])
            except ScheduleError as exc:
                raise ConfigError(f"{LABEL} {name!r}: schedule: {exc}") from None

        def change(live: Dict[str, StoredRow], now: datetime) -> Tuple[List[Dict[str, Any]], List[str]]:
            if name not in live:
                raise UnknownSchedule(name)
            values = self._values(live[name])
            values.update(fields)
            return [self._definition(name, values)], []

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
        removed: List[bool] = []

        def change(live: Dict[str, StoredRow], now: datetime) -> Tuple[List[Dict[str, Any]], List[str]]:
            removed.append(name in live)
            return [], [name]

        self._change([name], change)
        return removed[0]

    def get(self, name: str) -> Optional[StoredSchedule]:
        """The stored schedule *name*, or None."""
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
