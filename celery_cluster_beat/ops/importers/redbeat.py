"""RedBeat's schedules, read from its Redis keys: no RedBeat at run time.

RedBeat (celery-redbeat 2.x) keeps each entry in a hash ``<prefix><name>`` (the prefix is its
``redbeat_key_prefix`` setting as is, ``redbeat:`` by default) with a ``definition`` field (JSON:
name, task, args, kwargs, options, schedule, enabled) and a ``meta`` field (last run), and lists
every entry's key in the sorted set ``<prefix>:schedule``, scored by the next run; the names of
the entries that came from its app's ``beat_schedule`` are in the set ``<prefix>:statics``.

Its JSON encodes schedules as objects with a ``__type__``: ``interval`` (``every`` seconds,
``relative``), ``crontab`` (Celery's five field texts, in the app's zone), ``rrule``
(dateutil's recurrence rule) and ``datetime`` / ``weekday`` inside them. Intervals and crontabs
map as django-celery-beat's do (:mod:`.mapping`); an rrule is refused by name (its recurrences
have no cron or interval form here); static entries are skipped (they belong in
``beat_schedule``). Reads are bounded: at most :data:`MAX_ENTRIES` keys, each ``definition``
measured (``HSTRLEN``) before it is read, at most :data:`MAX_DEFINITION` bytes.
"""
from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Set

from ...errors import ConfigError
from ...leader.urls import mask_url
from ...dynamic.convert import json_depth_problem
from .mapping import Planned, ReadBudget, Refused, crontab_rule, interval_rule, json_value

SOURCE = "RedBeat"
DEFAULT_PREFIX = "redbeat:"
#: Most entries read from the schedule's sorted set: past it the import refuses rather than read on.
MAX_ENTRIES = 100_000
#: Longest ``definition`` read (bytes): three JSON values of at most 65,535 bytes each, and the rest.
MAX_DEFINITION = 4 * 65_536
_BATCH = 500
RRULE_REASON = ("RedBeat's rrule schedules are not imported: a recurrence rule (dateutil) has no exact cron or "
                "interval form here; write it as cron() or every()")


def _client(url: str) -> Any:
    import redis

    try:
        return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    except ValueError as exc:
        raise ConfigError(f"--redis {mask_url(url)}: {exc}") from None


def read(url: str, prefix: str = DEFAULT_PREFIX) -> List[Planned]:
    """Every entry of the RedBeat schedule at *url* under *prefix*, planned (:func:`plan_entry`)."""
    client = _client(url)
    try:
        schedule_key = prefix + ":schedule"
        count = client.zcard(schedule_key)
        if count > MAX_ENTRIES:
            raise ConfigError(f"{schedule_key}: more than {MAX_ENTRIES} entries; nothing was imported")
        if count == 0 and not client.exists(schedule_key):
            raise ConfigError(f"--redis {mask_url(url)}: no key {schedule_key!r} (no RedBeat schedule under the "
                              f"prefix {prefix!r}: --key-prefix is RedBeat's redbeat_key_prefix, as is)")
        if client.scard(prefix + ":statics") > MAX_ENTRIES:
            raise ConfigError(f"{prefix}:statics: more than {MAX_ENTRIES} names; nothing was imported")
        statics = _decoded(set(client.sscan_iter(prefix + ":statics", count=_BATCH))) if count else set()
        keys: List[bytes] = []
        for start in range(0, count, _BATCH):
            keys.extend(client.zrange(schedule_key, start, start + _BATCH - 1))
        keys = sorted(set(keys))[:MAX_ENTRIES]
        planned = []
        budget = ReadBudget(f"--redis {mask_url(url)}")
        for start in range(0, len(keys), _BATCH):
            batch = keys[start:start + _BATCH]
            pipe = client.pipeline(transaction=False)
            for key in batch:
                pipe.hstrlen(key, "definition")
            # A key that is not a hash (written past RedBeat) answers WRONGTYPE: that entry is refused.
            sizes = [size if isinstance(size, int) else -1 for size in pipe.execute(raise_on_error=False)]
            budget.spend(sum(size for size in sizes if 0 < size <= MAX_DEFINITION))  # before reading them
            pipe = client.pipeline(transaction=False)
            for key, size in zip(batch, sizes):
                if 0 < size <= MAX_DEFINITION:
                    pipe.hget(key, "definition")
            texts = iter(pipe.execute())
            for key, size in zip(batch, sizes):
                text = next(texts) if 0 < size <= MAX_DEFINITION else None
                planned.append(plan_entry(key, prefix, text, size, statics))
        return planned
    finally:
        client.close()


def _name(key: bytes, prefix: str) -> str:
    text = key.decode("utf-8", "backslashreplace")
    return text[len(prefix):] if text.startswith(prefix) else text


def plan_entry(key: bytes, prefix: str, text: Optional[bytes], size: int, statics: Set[str]) -> Planned:
    """The stored schedule RedBeat's entry at *key* becomes (its ``definition`` *text*, *size* bytes
    long, None when not read), or why it does not."""
    name = _name(key, prefix)
    if text is None:
        reason = ("no definition (the key has no 'definition' field)" if size == 0 else
                  "not a RedBeat entry (the key is not a hash)" if size < 0 else
                  f"its definition is {size} bytes, more than the {MAX_DEFINITION} read")
        return Planned(name, "?", reason=reason)
    try:
        definition = decode(text)
    except Refused as exc:
        return Planned(name, "?", reason=str(exc))
    schedule = definition.get("schedule")
    what = _what(schedule)
    if name in statics:
        return Planned(name, what, skipped=True,
                       reason="a static entry (from RedBeat's app's beat_schedule): keep it in beat_schedule")
    try:
        return Planned(name, what, **_plan(definition, schedule))
    except Refused as exc:
        return Planned(name, what, reason=str(exc))


def _decoded(statics: Set[bytes]) -> Set[str]:
    return {s.decode("utf-8", "backslashreplace") for s in statics}


def decode(text: bytes) -> Dict[str, Any]:
    """RedBeat's definition JSON, its ``__type__`` objects left as dicts; Refused when unreadable."""
    try:
        value = json.loads(text)
    except RecursionError:
        raise Refused("definition: nested too deep") from None
    except ValueError as exc:
        raise Refused(f"definition: not valid JSON ({str(exc)[:100]})") from None
    if not isinstance(value, dict):
        raise Refused("definition: not a JSON object")
    return value


def _what(schedule: Any) -> str:
    if not isinstance(schedule, dict):
        return f"schedule {str(schedule)[:40]!r}"
    kind = schedule.get("__type__")
    if kind == "crontab":
        fields = " ".join(str(schedule.get(k, "*"))[:60] for k in ("minute", "hour", "day_of_month",
                                                                   "month_of_year", "day_of_week"))
        return f"crontab {fields} (app zone)"
    if kind == "interval":
        return f"interval every {schedule.get('every')!s:.20} s"
    return f"{str(kind)[:20]} schedule"


def _plan(definition: Dict[str, Any], schedule: Any) -> Dict[str, Any]:
    """``spec`` and ``notes`` of a RedBeat definition."""
    kind = schedule.get("__type__") if isinstance(schedule, dict) else None
    if kind == "rrule":
        raise Refused(RRULE_REASON)
    if kind == "crontab":
        rule, notes = crontab_rule(schedule, None)  # RedBeat's crontab has no zone: Celery's app zone
    elif kind == "interval":
        rule, notes = interval_rule(schedule.get("every"), SOURCE)
    else:
        raise Refused(f"schedule of type {str(kind)[:40]!r}: not one RedBeat writes (interval, crontab, rrule)")
    args = definition.get("args") or []
    kwargs = definition.get("kwargs") or {}
    options = definition.get("options") or {}
    for key, value, kind_ in (("args", args, (list,)), ("kwargs", kwargs, (dict,)), ("options", options, (dict,))):
        if not isinstance(value, kind_):
            raise Refused(f"{key}: expected a JSON {'list' if kind_ == (list,) else 'object'}")
        reason = json_depth_problem(value)  # depth first: json.dumps recurses
        if reason:
            raise Refused(f"{key}: {reason}")
        json_value(json.dumps(value), key, kind_[0])  # size, as for every source
    enabled = definition.get("enabled", True)
    spec = {"task": definition.get("task"), "schedule": rule, "args": args, "kwargs": kwargs, "options": options,
            "description": "", "enabled": bool(enabled)}
    return {"spec": spec, "notes": notes}
