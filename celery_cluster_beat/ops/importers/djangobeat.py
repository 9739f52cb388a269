"""django-celery-beat's schedules, read from its tables with SQLAlchemy: no Django at run time.

The tables (``django_celery_beat_periodictask`` and its ``crontabschedule``, ``intervalschedule``,
``clockedschedule`` and ``solarschedule``) are reflected, so a release of django-celery-beat
without a column (``headers``, ``expire_seconds``, ``clocked``...) reads as the column's default.
What is read is bounded: at most :data:`MAX_ROWS` rows per table, each text cell cut at
:data:`~.mapping.MAX_CELL` characters by the database itself (a longer one is refused by name),
dates read as text on SQLite and parsed here, so one bad cell refuses its row, never the import.

Each row maps to a stored schedule as :func:`plan_task` says (README: "Switching from
django-celery-beat or RedBeat"): crontab in its ``timezone``; interval on the epoch grid;
clocked as a one-off ``at(clocked_time)``; ``one_off`` with an interval or crontab as
``max_runs=1``; ``start_time`` / ``expires`` as ``start_at`` / ``end_at``; solar refused by name.
Naive datetimes are UTC (Django's ``USE_TZ``, on by default, stores UTC).
"""
from __future__ import annotations

import os
from datetime import datetime, timezone
from typing import Any, Dict, List, Mapping, Optional

from ...errors import ConfigError
from ...leader.urls import mask_url
from .bounds import OneOff
from .mapping import (MAX_CELL, Planned, ReadBudget, Refused, aware, crontab_rule, interval_rule, json_value,
                      zone_of)

SOURCE = "django-celery-beat"
PREFIX = "django_celery_beat_"
TABLES = {"task": "periodictask", "crontab": "crontabschedule", "interval": "intervalschedule",
          "clocked": "clockedschedule", "solar": "solarschedule"}
#: Most rows read from one table: past it the import refuses rather than read on.
MAX_ROWS = 100_000
PERIODS = {"days": 86400, "hours": 3600, "minutes": 60, "seconds": 1, "microseconds": 0.000001}
SOLAR_REASON = ("Celery's solar schedules are not supported: their instants come from floating-point astronomy "
                "that replicas need not agree on to the second; use cron() at a fixed wall time")


def _engine(url: str) -> Any:
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
    except Exception:
        raise ConfigError(f"--db {mask_url(url)}: not a database URL (e.g. postgresql://user@host/db, "
                          "sqlite:////path/db.sqlite3)") from None
    backend, driver = parsed.get_backend_name(), parsed.get_driver_name()
    options: Dict[str, Any] = {}
    if backend == "sqlite":
        path = parsed.database
        if not path or path == ":memory:" or not os.path.exists(path):
            raise ConfigError(f"--db {mask_url(url)}: no SQLite database file there")
    elif backend in ("postgresql", "postgres") and "+" not in parsed.drivername:
        parsed = parsed.set(drivername="postgresql+psycopg")  # the driver the claim store uses
    elif backend in ("mysql", "mariadb") and "+" not in parsed.drivername:
        parsed = parsed.set(drivername=f"{backend}+pymysql")
    if backend != "sqlite" and driver != "pysqlite":
        options["connect_args"] = {"connect_timeout": 5}
    return sa.create_engine(parsed, **options)


def _select(conn: Any, table: Any, budget: ReadBudget) -> List[Dict[str, Any]]:
    """At most MAX_ROWS rows of *table* by id, text cells cut at MAX_CELL by the database, streamed
    and counted against *budget*."""
    import sqlalchemy as sa

    sqlite = conn.dialect.name == "sqlite"
    columns = []
    for col in table.columns:
        if isinstance(col.type, sa.String):
            columns.append(sa.func.substr(col, 1, MAX_CELL).label(col.name))
        elif isinstance(col.type, (sa.DateTime, sa.Date)) and sqlite:  # text there: parsed per row, below
            columns.append(sa.type_coerce(col, sa.String).label(col.name))
        else:
            columns.append(col)
    query = sa.select(*columns)
    if "id" in table.columns:
        query = query.order_by(table.columns["id"])
    rows = []
    result = conn.execution_options(stream_results=True, yield_per=500).execute(query.limit(MAX_ROWS + 1))
    for r in result:
        row = dict(r._mapping)
        budget.spend(sum(len(v) for v in row.values() if isinstance(v, str)))
        rows.append(row)
    if len(rows) > MAX_ROWS:
        raise ConfigError(f"{table.name}: more than {MAX_ROWS} rows; nothing was imported")
    return rows


def read(url: str) -> List[Planned]:
    """Every periodic task of the django-celery-beat database at *url*, planned (:func:`plan_task`)."""
    import sqlalchemy as sa

    engine = _engine(url)
    try:
        with engine.connect() as conn:
            present = set(sa.inspect(conn).get_table_names())
            if PREFIX + TABLES["task"] not in present:
                raise ConfigError(f"--db {mask_url(url)}: no table {PREFIX + TABLES['task']} (not django-celery-beat's "
                                  "database, or its migrations were never run)")
            meta = sa.MetaData()
            found = {kind: sa.Table(PREFIX + name, meta, autoload_with=conn)
                     for kind, name in TABLES.items() if PREFIX + name in present}
            budget = ReadBudget(f"--db {mask_url(url)}")
            rows = {kind: _select(conn, table, budget) for kind, table in found.items()}
    finally:
        engine.dispose()
    by_id = {kind: {r.get("id"): r for r in rows.get(kind, [])} for kind in TABLES if kind != "task"}
    now = datetime.now(timezone.utc)
    return [plan_task(row, by_id, now) for row in rows["task"]]


def _when(value: Any, what: str) -> Optional[datetime]:
    """An aware UTC datetime from a column (a datetime, or SQLite's text); Refused when unreadable."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        try:
            value = datetime.fromisoformat(value.strip())
        except ValueError:
            raise Refused(f"{what}: {value[:40]!r} is not a date and time") from None
    if not isinstance(value, datetime):
        raise Refused(f"{what}: {str(value)[:40]!r} is not a date and time")
    return aware(value)


def _text(value: Any, what: str) -> Optional[str]:
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise Refused(f"{what}: expected text, got {type(value).__name__}")
    return value


def _kind(row: Mapping[str, Any], by_id: Mapping[str, Mapping[Any, Mapping[str, Any]]]):
    """(kind, its schedule row) of a periodic task; Refused with none, several or a missing one."""
    kinds = [k for k in ("interval", "crontab", "clocked", "solar") if row.get(f"{k}_id") is not None]
    if not kinds:
        raise Refused("no schedule (none of interval, crontab, clocked, solar is set)")
    if len(kinds) > 1:
        raise Refused(f"more than one schedule ({' and '.join(kinds)}); django-celery-beat allows one")
    kind = kinds[0]
    target = by_id.get(kind, {}).get(row[f"{kind}_id"])
    if target is None:
        raise Refused(f"its {kind} schedule (id {row[f'{kind}_id']}) is not in the database")
    return kind, target


def _what(kind: str, s: Mapping[str, Any]) -> str:
    if kind == "crontab":
        fields = " ".join(_cut(s.get(k, "*")) for k in ("minute", "hour", "day_of_month", "month_of_year",
                                                         "day_of_week"))
        return f"crontab {fields} ({_cut(s.get('timezone') or 'app zone')})"
    if kind == "interval":
        return f"interval every {_cut(s.get('every'))} {_cut(s.get('period'))}"
    if kind == "clocked":
        return f"clocked at {_cut(s.get('clocked_time'))}"
    return f"solar {_cut(s.get('event'))} at ({_cut(s.get('latitude'))}, {_cut(s.get('longitude'))})"


def _cut(value: Any, limit: int = 60) -> str:
    """A source value for a line of output: someone else's text, cut."""
    text = str(value)
    return text if len(text) <= limit else text[:limit] + "..."


def plan_task(row: Mapping[str, Any], by_id: Mapping[str, Mapping[Any, Mapping[str, Any]]],
              now: datetime) -> Planned:
    """The stored schedule a ``periodictask`` row becomes (its schedule rows in *by_id*: kind -> id -> row),
    or why it does not. *now*: aware, to tell an expired or spent one."""
    name = row.get("name")
    what = "?"
    try:
        kind, sched = _kind(row, by_id)
        what = _what(kind, sched)
        if kind == "solar":
            raise Refused(SOLAR_REASON)
        return _plan(row, kind, sched, what, now)
    except Refused as exc:
        return Planned(name, what, reason=str(exc))


def _plan(row: Mapping[str, Any], kind: str, sched: Mapping[str, Any], what: str, now: datetime) -> Planned:
    name = row.get("name")
    notes: List[str] = []
    rule: Any
    if kind == "crontab":
        rule, notes = crontab_rule(sched, zone_of(sched.get("timezone")))
    elif kind == "interval":
        every_n, period = sched.get("every"), sched.get("period")
        if period not in PERIODS or isinstance(every_n, bool) or not isinstance(every_n, int):
            raise Refused(f"interval every {every_n!r} {period!r}: not a count of days, hours, minutes, seconds "
                          "or microseconds")
        rule, notes = interval_rule(every_n * PERIODS[period] if period != "microseconds" else every_n / 1e6, SOURCE)
    else:
        when = _when(sched.get("clocked_time"), "clocked_time")
        if when is None:
            raise Refused("clocked schedule without a time")
        rule = OneOff(when)
    enabled = bool(row.get("enabled", True))
    one_off = bool(row.get("one_off") or kind == "clocked")
    runs = row.get("total_run_count") or 0
    # django-celery-beat disables a one-off after its run, resetting its count and (as it saves any
    # disabled task) its last run: a disabled one-off cannot be told from a spent one, and is taken as spent.
    if one_off and runs:
        return Planned(name, what, reason=f"a one-off that already ran (total_run_count {runs})", skipped=True)
    if one_off and not enabled:
        return Planned(name, what, skipped=True, reason="a disabled one-off: django-celery-beat disables a one-off "
                       "once it has run, so it is taken as spent (enable it there first to carry it over)")
    start = _when(row.get("start_time"), "start_time")
    end = _when(row.get("expires"), "expires")
    if end is not None and end <= now:
        return Planned(name, what, reason=f"expired at {end.isoformat()}", skipped=True)
    if isinstance(rule, OneOff) and rule.when <= now:
        raise Refused(f"its clocked time {rule.when.isoformat()} has passed and it never ran (django-celery-beat "
                      "would send it when it next starts): not carried over; run the task by hand if still wanted")
    args = json_value(_text(row.get("args"), "args"), "args", list)
    kwargs = json_value(_text(row.get("kwargs"), "kwargs"), "kwargs", dict)
    options = _options(row, end, notes)
    spec: Dict[str, Any] = {"task": row.get("task"), "schedule": rule, "args": args, "kwargs": kwargs,
                            "options": options, "description": row.get("description") or "", "enabled": enabled}
    if start is not None and start > now:  # a start that has passed bounds nothing any more
        spec["start_at"] = start
    if end is not None:
        spec["end_at"] = end
    if one_off and not isinstance(rule, OneOff):
        spec["max_runs"] = 1
    return Planned(name, what, spec=spec, notes=notes)


def _options(row: Mapping[str, Any], end: Optional[datetime], notes: List[str]) -> Dict[str, Any]:
    """Celery's send options as django-celery-beat's ``ModelEntry`` builds them."""
    options: Dict[str, Any] = {}
    for key in ("queue", "exchange", "routing_key"):
        value = _text(row.get(key), key)
        if value is not None:
            options[key] = value
    priority = row.get("priority")
    if priority is not None:
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise Refused(f"priority {str(priority)[:20]!r}: not a number")
        options["priority"] = priority
    expire_seconds = row.get("expire_seconds")
    if end is not None:
        notes.append("its messages no longer expire at 'expires' (django-celery-beat sent that instant as each "
                     "message's expiry" + (" and ignored expire_seconds)" if expire_seconds else ")"))
    elif expire_seconds:
        if isinstance(expire_seconds, bool) or not isinstance(expire_seconds, int):
            raise Refused(f"expire_seconds {str(expire_seconds)[:20]!r}: not a number")
        options["expires"] = expire_seconds
    headers = json_value(_text(row.get("headers"), "headers"), "headers", dict)
    headers["periodic_task_name"] = row.get("name")  # django-celery-beat sends it with every message
    options["headers"] = headers
    return options
