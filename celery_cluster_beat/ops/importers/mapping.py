"""What another scheduler's rule, arguments and options become as a stored schedule. Pure.

A schedule is carried over only when it fires exactly as it did: a rule with no exact cron or
interval form here is refused with the reason, never imported with other instants.

* **Celery's crontab** (django-celery-beat's and RedBeat's): its fields are read by Celery's own
  parser (``*/15``, ranges, names, Celery's wrapping steps), and written as cron text only when
  our parser reads that text as the same value sets. Celery combines the two day fields with
  AND; cron text ORs them when both are restricted and neither starts with ``*`` (Vixie). So
  where both are restricted the AND is written in a form that means it: day-of-month blocks of
  whole weeks (1-7, 8-14, 15-21, 22-28, 29-31) become ``n#k`` weekday terms (``1-7`` and ``mon``
  is ``* * mon#1``, the first Monday), or a leading ``*/N`` term (Vixie's rule: a field starting
  with ``*`` means AND); otherwise the schedule is refused. Every result is checked day by day
  against Celery's rule, on each kind of month (each length, starting on each weekday), before it
  is accepted.
* **Intervals** become :func:`~celery_cluster_beat.every` on the epoch grid (a note, not a refusal:
  Celery counts from the last run).
* Arguments, keyword arguments and headers are JSON read bounded (size, depth).
"""
from __future__ import annotations

import calendar
import json
import math
import re
from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone
from decimal import Decimal
from functools import lru_cache
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Tuple

from ...config.values import MAX_TEXT_BYTES
from ...dynamic.convert import json_depth_problem
from ...errors import ConfigError, ScheduleError
from ...schedules.celery_types import cron, every
from ...schedules.cronexpr import CronSpec, parse_cron
from ...schedules.tzwall import get_zone

#: Longest text cell read from another scheduler's store (characters): what a stored schedule may
#: keep (JSON of at most :data:`MAX_TEXT_BYTES`) plus one, so that a longer one is seen as such.
MAX_CELL = MAX_TEXT_BYTES + 1
#: Longest crontab field read (Celery's parser is given nothing longer).
MAX_CRON_FIELD = 256
#: Longest zone name read.
MAX_ZONE = 64

CRONTAB_FIELDS = ("minute", "hour", "day_of_month", "month_of_year", "day_of_week")
_FULL: Dict[str, FrozenSet[int]] = {
    "minute": frozenset(range(60)), "hour": frozenset(range(24)), "day_of_month": frozenset(range(1, 32)),
    "month_of_year": frozenset(range(1, 13)), "day_of_week": frozenset(range(7))}
#: Where each Celery field sits in a probe expression our parser reads, and what it yields.
_PROBES = {"minute": ("{} 0 * * *", "minutes"), "hour": ("0 {} * * *", "hours"),
           "day_of_month": ("0 0 {} * *", "days"), "month_of_year": ("0 0 * {} *", "months"),
           "day_of_week": ("0 0 * * {}", "weekdays")}
_PLAIN = re.compile(r"^[0-9A-Za-z*,/-]+$")
#: Day-of-month blocks whose days are exactly the k-th occurrence of a weekday in any month.
_WEEK_BLOCKS = {1: frozenset(range(1, 8)), 2: frozenset(range(8, 15)), 3: frozenset(range(15, 22)),
                4: frozenset(range(22, 29)), 5: frozenset(range(29, 32))}


#: Most text read from one source in all (characters or bytes): each cell is bounded, and so is their sum.
MAX_TOTAL_READ = 256 * 1024 * 1024


class ReadBudget:
    """What one import may read in all; past it, the import stops before anything is written."""

    def __init__(self, what: str, limit: Optional[int] = None) -> None:
        self.what, self.limit, self.used = what, MAX_TOTAL_READ if limit is None else limit, 0

    def spend(self, size: int) -> None:
        self.used += size
        if self.used > self.limit:
            raise ConfigError(f"{self.what}: more than {self.limit:,} characters of schedules to read; "
                              "nothing was imported")


class Refused(Exception):
    """A schedule that cannot be carried over as it is; the message says why."""


@dataclass
class Planned:
    """One schedule of the source: what it is, and the stored schedule it becomes (``spec``: the
    keyword arguments of :meth:`StoredSchedules.add`, without the name) or why not (``reason``;
    ``skipped`` when nothing is lost by leaving it, e.g. a one-off that already ran)."""

    name: Any
    what: str
    spec: Optional[Dict[str, Any]] = None
    reason: Optional[str] = None
    skipped: bool = False
    notes: List[str] = field(default_factory=list)


def interval_note(source: str) -> str:
    return (f"fires on the epoch grid (k x interval since 1970-01-01 UTC), not one interval after the last "
            f"run as {source} counts")


def aware(value: Optional[datetime]) -> Optional[datetime]:
    """*value* as an aware UTC datetime (a naive one is read as UTC: Django's ``USE_TZ`` default)."""
    if value is None:
        return None
    if value.tzinfo is None:
        return value.replace(tzinfo=timezone.utc)
    return value.astimezone(timezone.utc)


def json_value(text: Any, what: str, kind: type) -> Any:
    """The JSON *text* of a list or dict (*kind*), bounded in size and depth; :class:`Refused` when not."""
    if text is None or text == "":
        return kind()
    if not isinstance(text, str):
        raise Refused(f"{what}: expected JSON text, got {type(text).__name__}")
    if len(text) > MAX_TEXT_BYTES:
        raise Refused(f"{what}: more than {MAX_TEXT_BYTES} characters of JSON")
    try:
        value = json.loads(text)
    except RecursionError:
        raise Refused(f"{what}: nested too deep") from None
    except ValueError as exc:
        raise Refused(f"{what}: not valid JSON ({str(exc)[:100]})") from None
    if not isinstance(value, kind):
        raise Refused(f"{what}: expected a JSON {'list' if kind is list else 'object'}, got {type(value).__name__}")
    reason = json_depth_problem(value)
    if reason:
        raise Refused(f"{what}: {reason}")
    return value


def zone_of(value: Any) -> Optional[str]:
    """An IANA zone name read from the source (None or empty: the app's zone); Refused when unknown."""
    if value is None or value == "":
        return None
    if not isinstance(value, str) or len(value) > MAX_ZONE:
        raise Refused(f"timezone {str(value)[:MAX_ZONE]!r}: not an IANA zone name")
    try:
        get_zone(value)
    except ScheduleError as exc:
        raise Refused(f"timezone: {exc}") from None
    return value


# ----------------------------------------------------------------------------- intervals


def interval_rule(seconds: Any, source: str) -> Tuple[every, List[str]]:
    """``every(seconds)`` on the epoch grid, with the note that says how it differs from *source*."""
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float, Decimal)) or not math.isfinite(seconds):
        raise Refused(f"interval {seconds!r}: not a number of seconds")
    if seconds < 1:
        raise Refused(f"interval of {seconds} s: stored schedules fire at most once a second")
    try:
        rule = every(timedelta(microseconds=int(round(Decimal(str(seconds)) * 1_000_000))))
    except (ScheduleError, OverflowError, ValueError) as exc:
        raise Refused(f"interval of {seconds} s: {exc}") from None
    return rule, [interval_note(source)]


# ----------------------------------------------------------------------------- Celery's crontab


def _read_as(key: str, text: str) -> Optional[FrozenSet[int]]:
    """The values our parser reads in *text* as Celery field *key*; None when it does not read it plainly."""
    if not _PLAIN.match(text):
        return None
    probe, attr = _PROBES[key]
    try:
        spec = parse_cron(probe.format(text))
    except ScheduleError:
        return None
    if spec.selector is not None:  # L, W or #: Celery has none of them
        return None
    return frozenset(getattr(spec, attr))


def _compressed(values: FrozenSet[int]) -> str:
    """``1,2,3,5`` as ``1-3,5``: the value set as plain cron terms."""
    ordered = sorted(values)
    terms: List[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        if j - i >= 2:
            terms.append(f"{ordered[i]}-{ordered[j]}")
        else:
            terms.extend(str(v) for v in ordered[i:j + 1])
        i = j + 1
    return ",".join(terms)


def _field_text(key: str, original: str, values: FrozenSet[int]) -> str:
    if values == _FULL[key]:
        return "*"
    if _read_as(key, original) == values:
        return original  # as the user wrote it (``*/15``, ``mon-fri``)
    return _compressed(values)


def _nth_form(days: FrozenSet[int], weekdays: FrozenSet[int]) -> Optional[str]:
    """Day-of-week text with ``n#k`` terms meaning *days* AND *weekdays*, when *days* is whole weeks."""
    blocks = [k for k, block in _WEEK_BLOCKS.items() if block <= days]
    if not blocks or frozenset().union(*(_WEEK_BLOCKS[k] for k in blocks)) != days:
        return None
    return ",".join(f"{w}#{k}" for w in sorted(weekdays) for k in blocks)


def _star_form(values: FrozenSet[int], lo: int, hi: int, size: int) -> Optional[str]:
    """*values* written as ``*/N[,rest]`` (Vixie: a field starting with ``*`` makes the day rule AND)."""
    for step in range(size - 1, 0, -1):
        head = frozenset(range(lo, hi + 1, step))
        if head <= values:
            rest = values - head
            return f"*/{step}" + (f",{_compressed(rest)}" if rest else "")
    return None


def _day_matches(spec: CronSpec, day: date) -> bool:
    weekday = day.isoweekday() % 7
    if spec.selector is not None:
        return spec.selector.matches(day.year, day.month, day.day, weekday)
    return spec.day_matches(day.day, weekday)


@lru_cache(maxsize=1)
def _month_kinds() -> Tuple[Tuple[int, int], ...]:
    """One (year, month) of each kind of month: each length (28-31) starting on each weekday. Which
    days a day rule picks (plain, ``L``, ``W``, ``#``) depends on nothing else of a month."""
    found: Dict[Tuple[int, int], Tuple[int, int]] = {}
    for year in range(2024, 2052):  # 28 years: every calendar of 1901-2099
        for month in range(1, 13):
            found.setdefault(calendar.monthrange(year, month), (year, month))
    return tuple(found.values())


def _same_days(spec: CronSpec, days: FrozenSet[int], weekdays: FrozenSet[int]) -> bool:
    """Whether *spec* picks the same days as Celery's AND of *days* and *weekdays*, on every day of
    every kind of month (months aside: their sets are compared as they are)."""
    for year, month in _month_kinds():
        for number in range(1, calendar.monthrange(year, month)[1] + 1):
            day = date(year, month, number)
            if _day_matches(spec, day) != (number in days and day.isoweekday() % 7 in weekdays):
                return False
    return True


def crontab_rule(fields: Mapping[str, Any], tz: Optional[str]) -> Tuple[cron, List[str]]:
    """``cron(text, tz)`` firing exactly as Celery's ``crontab(**fields)`` in zone *tz*; Refused when
    no cron text says the same. Returns the rule and notes on how it was written."""
    texts: Dict[str, str] = {}
    for key in CRONTAB_FIELDS:
        value = fields.get(key, "*")
        value = "*" if value is None else value
        if isinstance(value, bool) or not isinstance(value, (str, int)) or not str(value).strip():
            raise Refused(f"crontab {key}: expected cron field text, got {str(value)[:40]!r}")
        text = str(value).strip()
        if len(text) > MAX_CRON_FIELD:
            raise Refused(f"crontab {key}: longer than {MAX_CRON_FIELD} characters")
        texts[key] = text
    label = "crontab(" + ", ".join(f"{k}={texts[k]!r}" for k in CRONTAB_FIELDS) + ")"
    from celery.schedules import crontab

    try:
        parsed = crontab(**texts)  # Celery's own reading of the fields
    except Exception as exc:  # Celery's ParseException / ValueError: its own words
        raise Refused(f"{label}: Celery cannot read it ({str(exc)[:200]})") from None
    sets = {key: frozenset(getattr(parsed, key)) for key in CRONTAB_FIELDS}
    out = {key: _field_text(key, texts[key], sets[key]) for key in CRONTAB_FIELDS}
    days, weekdays = sets["day_of_month"], sets["day_of_week"]
    notes: List[str] = []
    both = days != _FULL["day_of_month"] and weekdays != _FULL["day_of_week"]
    if both and not (out["day_of_month"].startswith("*") or out["day_of_week"].startswith("*")):
        nth = _nth_form(days, weekdays)
        star_dom = _star_form(days, 1, 31, 31)
        star_dow = _star_form(weekdays, 0, 6, 7)
        if nth is not None:
            out["day_of_month"], out["day_of_week"] = "*", nth
            notes.append("both day fields restricted: Celery's AND written as n#k weekday terms")
        elif star_dom is not None or star_dow is not None:
            if star_dom is not None:
                out["day_of_month"] = star_dom
            else:
                out["day_of_week"] = star_dow
            notes.append("both day fields restricted: Celery's AND kept by a leading '*/N' term (Vixie's rule)")
        else:
            raise Refused(f"{label}: both day fields are restricted and Celery fires only on days matching both "
                          f"(AND); cron text combines them with OR, and no cron text here says exactly these "
                          "days (no '#' weekday or leading '*/N' form fits): write it as cron() with one day "
                          "field and check the other day in the task")
    text = " ".join(out[key] for key in ("minute", "hour", "day_of_month", "month_of_year", "day_of_week"))
    try:
        rule = cron(text, tz=tz)
    except ScheduleError as exc:
        raise Refused(f"{label}: {exc}") from None
    spec = rule.spec
    wildcard = any(texts[key].startswith("*") for key in ("minute", "hour"))  # Celery's crontab conversion's rule
    if (frozenset(spec.minutes), frozenset(spec.hours), frozenset(spec.months)) != (
            sets["minute"], sets["hour"], sets["month_of_year"]) or spec.wildcard != wildcard:
        raise Refused(f"{label}: no cron text here reads as the same minutes, hours and months with the same "
                      "daylight-saving rule")
    if both and not _same_days(spec, days, weekdays):  # pragma: no cover - the forms above are exact: the proof
        raise Refused(f"{label}: the cron text {text!r} would fire on other days than Celery's crontab")
    return rule, notes


def rule_words(rule: Any) -> str:
    """A rule as the dry run shows what it becomes."""
    if isinstance(rule, cron):
        return f"cron {rule.expr!r}" + (f" {rule.tz_name}" if rule.tz_name else "")
    if isinstance(rule, every):
        from ...schedules.text import schedule_text

        return schedule_text(rule)[0]
    return str(rule)
