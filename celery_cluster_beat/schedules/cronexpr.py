"""Parsing and validating cron expressions: Vixie's 5 fields, plus croniter's extensions.

Pure: text in, :class:`CronSpec` out. A plain 5-field expression follows Vixie
cron, the reference operators trust, with this module's own parser (no
croniter involved). On top of it, the extensions croniter (the peer users compare
with) reads the same way:

* ranges that wrap: ``22-2`` in hours is 22,23,0,1,2 and ``fri-mon`` is Fri-Mon;
  a step over a wrapping range counts as croniter counts it (:func:`_wrapped`:
  ``Thu-Tue/2`` is Thu, Sat, Tue; ``23-3/2`` in hours is 23, 2);
* ``L``, ``W`` and ``#`` in the day fields (:mod:`.cronext`, parsed with croniter);
* croniter's optional sixth field, *seconds*, after day-of-week
  (``m h dom mon dow sec``).

What croniter accepts but reads otherwise elsewhere is refused naming the field,
because a schedule that means something else on another tool is worse than an
error at start-up: ``?``, hashed ``H`` and random ``R`` values, a year field,
Quartz's seconds-first order (a bare ``*`` sixth field), ``5L``, ``LW``, ``L-3``.
"""
from __future__ import annotations

import calendar
import re
from dataclasses import dataclass
from enum import Enum
from functools import lru_cache
from typing import FrozenSet, Optional, Tuple

from .cronext import DaySelector, has_day_extension, parse_day_fields
from .errors import ScheduleError

__all__ = ["CronSpec", "DayRule", "parse_cron", "FIELD_NAMES", "MAX_CRON_LENGTH"]

#: Longest expression accepted (characters): a real one is a few dozen; longer text is refused up front.
MAX_CRON_LENGTH = 1000

FIELD_NAMES = ("minute", "hour", "day-of-month", "month", "day-of-week")
#: The optional sixth field, as messages name it (croniter's order: after day-of-week, not first as in Quartz).
SECOND_FIELD = "second (6th field, after day-of-week)"
_BOUNDS = {"minute": (0, 59), "hour": (0, 23), "day-of-month": (1, 31), "month": (1, 12), "day-of-week": (0, 7),
           SECOND_FIELD: (0, 59)}
_MONTHS = {name.lower(): i for i, name in enumerate(calendar.month_abbr) if name}
_WEEKDAYS = {"sun": 0, "mon": 1, "tue": 2, "wed": 3, "thu": 4, "fri": 5, "sat": 6}
_NAMES = {"month": _MONTHS, "day-of-week": _WEEKDAYS}
_MONTH_NAMES = [calendar.month_name[i] for i in range(13)]
_MAX_DAYS = {1: 31, 2: 29, 3: 31, 4: 30, 5: 31, 6: 30, 7: 31, 8: 31, 9: 30, 10: 31, 11: 30, 12: 31}

SHORTHANDS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}
#: Fields are separated by ASCII blanks only, as in a crontab file (Unicode spaces are not separators).
_BLANKS = re.compile(r"[ \t\n\r\f\v]+")
_UNSUPPORTED_CHARS = {"L": "last-day", "W": "nearest-weekday", "#": "nth-weekday", "?": "no-specific-value",
                      "H": "hashed, needs a per-job hash id", "R": "random, differs per process"}
_UNSUPPORTED_SET = frozenset(_UNSUPPORTED_CHARS)
_DAY_ONLY = {"L": "day-of-month or day-of-week", "W": "day-of-month", "#": "day-of-week"}


class DayRule(str, Enum):
    """How the day-of-month and day-of-week fields combine when both are restricted."""

    VIXIE = "vixie"  # OR, as Vixie cron
    AND = "and"  # AND, as Celery's crontab


@dataclass(frozen=True)
class CronSpec:
    """The value sets of a cron expression plus the flags Vixie derives from its text.

    ``dom_star`` / ``dow_star`` decide the day rule (OR when both are
    restricted) and ``wildcard`` decides the DST rule; both come from the
    *text* (a field starting with ``*``), not from the value sets, exactly as
    in Vixie's ``DOM_STAR``/``DOW_STAR``/``MIN_STAR``/``HR_STAR`` flags (with a
    seconds field, a second field starting with ``*`` makes the job wildcard too).

    ``seconds`` is None without a seconds field (the job fires at second 0).
    ``selector`` is set when a day field uses ``L``, ``W`` or ``#``: it then decides
    the day (:meth:`.cronext.DaySelector.matches`, which needs the year and month),
    and ``days`` / ``weekdays`` only hold each field's plain values (the whole
    range for a field without any), for display.
    """

    text: str
    minutes: Tuple[int, ...]
    hours: Tuple[int, ...]
    days: FrozenSet[int]
    months: Tuple[int, ...]
    weekdays: FrozenSet[int]  # 0 = Sunday .. 6 = Saturday
    dom_star: bool
    dow_star: bool
    wildcard: bool
    day_rule: DayRule = DayRule.VIXIE
    seconds: Optional[Tuple[int, ...]] = None
    selector: Optional[DaySelector] = None

    @property
    def extended(self) -> bool:
        """Whether the expression uses a day extension or a seconds field (its value sets alone
        do not say when it fires: describe it by its text)."""
        return self.selector is not None or self.seconds is not None

    def day_matches(self, day: int, weekday_sun0: int) -> bool:
        dom = day in self.days
        dow = weekday_sun0 in self.weekdays
        if self.day_rule == DayRule.VIXIE and not (self.dom_star or self.dow_star):
            return dom or dow
        return dom and dow


def _fail(expr: str, field: str, reason: str) -> ScheduleError:
    return ScheduleError(f"cron {expr!r}: {field} {reason}")


def _ascii_digits(token: str) -> bool:
    """Whether *token* is one or more ASCII digits (``str.isdigit`` also accepts '٣' and '²')."""
    return token.isascii() and token.isdigit()


def _check_characters(expr: str, field: str, text: str) -> None:
    """Cron is ASCII: refuse other scripts' digits, superscripts, control characters... naming the field."""
    for ch in text:
        if not (ch.isascii() and ch.isprintable()):
            kind = "a control character" if ch.isascii() else "not an ASCII character"
            raise _fail(expr, field, f"{text!r} contains {ch!r} (U+{ord(ch):04X}), {kind}; cron fields are "
                                     "ASCII digits, month or weekday names and '*', ',', '-', '/'")


def _number(expr: str, field: str, token: str) -> int:
    names = _NAMES.get(field)
    if names and token.lower() in names:
        return names[token.lower()]
    if not _ascii_digits(token):
        if names:
            kind = "month" if field == "month" else "weekday"
            return _raise(expr, field, f"{token!r} is not a number or a {kind} name")
        return _raise(expr, field, f"{token!r} is not a number")
    value = int(token)
    lo, hi = _BOUNDS[field]
    if not lo <= value <= hi:
        return _raise(expr, field, f"value {value} is out of range {lo}-{hi}")
    return value


def _raise(expr: str, field: str, reason: str) -> int:
    raise _fail(expr, field, reason)


def _parse_field(expr: str, field: str, text: str) -> FrozenSet[int]:
    lo, hi = _BOUNDS[field]
    size = hi - lo + 1 if field != "day-of-week" else 7
    upper = text.upper()
    for ch, what in _UNSUPPORTED_CHARS.items() if _UNSUPPORTED_SET.intersection(upper) else ():
        if ch in upper and not (field in _NAMES and _contains_name_with(text, ch)):
            where = f" (only in {_DAY_ONLY[ch]})" if ch in _DAY_ONLY else ""
            raise _fail(expr, field, f"{text!r}: '{ch}' ({what}) is not supported here{where}; use Vixie cron syntax")
    values: set = set()
    for term in text.split(","):
        if term == "":
            raise _fail(expr, field, f"{text!r} has an empty term")
        step = 1
        if "/" in term:
            base, _, step_text = term.partition("/")
            if not _ascii_digits(step_text):
                raise _fail(expr, field, f"step {step_text!r} in {term!r} is not a number")
            step = int(step_text)
            if step == 0:
                raise _fail(expr, field, f"step 0 in {term!r} is not allowed")
            if step >= size:
                raise _fail(
                    expr, field, f"step {step} in {term!r} is not smaller than the field's {size} values (a typo?)"
                )
            if base != "*" and "-" not in base:
                raise _fail(expr, field, f"{term!r}: a step needs '*' or a range before it ('{base}-{hi}/{step}')")
        else:
            base = term
        if base == "*":
            start, end = lo, hi
            if field == "day-of-week":
                end = 6
        elif "-" in base:
            a, _, b = base.partition("-")
            if a == "" or b == "":
                raise _fail(expr, field, f"range {base!r} is incomplete")
            start, end = _number(expr, field, a), _number(expr, field, b)
            if start > end:  # wraps past the field's end, as in croniter: 22-2 is 22,23,0,1,2
                values.update(_wrapped(expr, field, base, start, end, step))
                continue
        else:
            start = end = _number(expr, field, base)
        values.update(range(start, end + 1, step))
    if field == "day-of-week" and 7 in values:
        values.discard(7)
        values.add(0)
    return frozenset(values)


def _wrapped(expr: str, field: str, base: str, start: int, end: int, step: int) -> FrozenSet[int]:
    """A range that wraps (``22-2``, ``fri-mon``), read as croniter reads it.

    With a step, croniter restarts the count after the wrap at ``lo + (step - values left
    before the end)`` when the step overshoots the field's end, else at ``lo``: ``Thu-Tue/2``
    is Thu, Sat, Tue and ``23-3/2`` in hours is 23, 2 (counting on through the wrap would
    give Mon and 1, 3). Kept for agreement with croniter, the peer these ranges come from.
    """
    lo, hi = _BOUNDS[field]
    if field == "day-of-week":  # croniter reads 7 as 0 first, on a 0-6 field
        start, end, hi = start % 7, end % 7, 6
        if start == end:
            raise _fail(expr, field, f"range {base!r} is ambiguous (croniter reads it as every day); "
                                     "write '*' or the one day")
        if start < end:
            return frozenset(range(start, end + 1, step))
    first = list(range(start, hi + 1, step))
    skip = 0
    if first and (first[-1] - lo) + step > hi - lo + 1 and hi - first[-1] < step:
        skip = step - (hi - first[-1])
    return frozenset(first + list(range(lo + skip, end + 1, step)))


@lru_cache(maxsize=1024)
def _contains_name_with(text: str, ch: str) -> bool:
    """True when *ch* only appears inside month/weekday names (e.g. 'W' in 'WED')."""
    stripped = text.upper()
    for name in list(_MONTHS) + list(_WEEKDAYS):
        stripped = stripped.replace(name.upper(), "")
    return ch not in stripped


def _check_can_fire(expr: str, days: FrozenSet[int], months: Tuple[int, ...], dom_only: bool) -> None:
    """Reject day/month combinations that never occur (``0 0 30 2 *``).

    Only relevant when the day-of-month set alone decides the day (AND rule
    or day-of-week unrestricted): under the OR rule any weekday occurs in
    every month, so the expression always fires.
    """
    if not dom_only:
        return
    smallest = min(days)
    if any(smallest <= _MAX_DAYS[m] for m in months):
        return
    names = [_MONTH_NAMES[m] for m in months]
    where = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]
    day_list = ",".join(str(d) for d in sorted(days))
    raise _fail(expr, "day-of-month", f"{day_list} never occurs in {where}")


def parse_cron(expr: str, *, day_rule: DayRule = DayRule.VIXIE) -> CronSpec:
    """Parse *expr* into a :class:`CronSpec`, raising :class:`ScheduleError` on any problem.

    Any text gives a spec or a :class:`ScheduleError` naming the field (or the whole
    expression), never another exception: cron is ASCII, so other scripts' digits
    ('٣', which ``int`` would read as 3), superscripts and control characters are
    refused, and so is text longer than :data:`MAX_CRON_LENGTH`.
    """
    if not isinstance(expr, str):
        raise ScheduleError(f"cron {expr!r}: expression must be a string, not {type(expr).__name__}")
    if len(expr) > MAX_CRON_LENGTH:
        raise ScheduleError(f"cron {expr[:40]!r}...: expression of {len(expr)} characters is too long "
                            f"(at most {MAX_CRON_LENGTH})")
    fields = [part for part in _BLANKS.split(expr) if part]
    shorthand = bool(fields) and fields[0].startswith("@")
    names = FIELD_NAMES + (SECOND_FIELD,) if len(fields) == 6 else FIELD_NAMES
    for i, part in enumerate(fields):
        named = names[i] if i < len(names) and not shorthand else "expression"
        _check_characters(expr, named, part)
    text = " ".join(fields)
    if text.startswith("@"):
        key = text.lower()
        if key == "@reboot":
            raise ScheduleError(f"cron {expr!r}: expression @reboot is not supported (a scheduler has no boot time)")
        if key.startswith("@every"):
            raise ScheduleError(f"cron {expr!r}: expression @every is not supported; use every(seconds) instead")
        if key not in SHORTHANDS:
            raise ScheduleError(f"cron {expr!r}: expression {text!r} is not a known shorthand; "
                                f"supported: {', '.join(SHORTHANDS)}")
        spec = parse_cron(SHORTHANDS[key], day_rule=day_rule)
        return CronSpec(**{**spec.__dict__, "text": expr})
    if len(fields) not in (5, 6):
        extra = " (a year field is not supported)" if len(fields) == 7 else ""
        raise ScheduleError(
            f"cron {expr!r}: expected 5 fields (minute hour day-of-month month day-of-week), or 6 with "
            f"seconds last, got {len(fields)}{extra}"
        )
    # seconds first: a bare '*' there is the mark of Quartz's seconds-first order, the likeliest mistake
    seconds = _parse_seconds(expr, fields[5]) if len(fields) == 6 else None
    dom_star = fields[2].startswith("*")
    dow_star = fields[4].startswith("*")
    selector = None
    if has_day_extension("day-of-month", fields[2]) or has_day_extension("day-of-week", fields[4]):
        if day_rule != DayRule.VIXIE:  # the selector combines the day fields as croniter does, never AND
            rule = getattr(day_rule, "value", day_rule)
            raise ScheduleError(f"cron {expr!r}: day rule {rule!r} applies to plain day fields only, "
                                "not to 'L', 'W' or '#' (they combine as in croniter)")
        minutes, hours, months_set = (_parse_field(expr, FIELD_NAMES[i], fields[i]) for i in (0, 1, 3))
        months = tuple(sorted(months_set))
        selector = parse_day_fields(expr, fields[2], fields[4], months, _parse_field)
        days = selector.dom or frozenset(range(1, 32))
        weekdays = selector.dow or frozenset(w for w, _ in selector.nth) or frozenset(range(7))
    else:  # Vixie's fields, checked in their order (the first bad one is named)
        minutes, hours, days, months_set, weekdays = (
            _parse_field(expr, name, part) for name, part in zip(FIELD_NAMES, fields))
        months = tuple(sorted(months_set))
        _check_can_fire(expr, days, months, dow_star or day_rule == DayRule.AND)
    return CronSpec(
        text=expr,
        minutes=tuple(sorted(minutes)),
        hours=tuple(sorted(hours)),
        days=days,
        months=months,
        weekdays=weekdays,
        dom_star=dom_star,
        dow_star=dow_star,
        wildcard=any(field.startswith("*") for field in fields[:2] + fields[5:]),  # minute, hour, second
        day_rule=day_rule,
        seconds=seconds,
        selector=selector,
    )


def _parse_seconds(expr: str, text: str) -> Tuple[int, ...]:
    """croniter's sixth field. A bare ``*`` (every second) is refused: it is what Quartz and Spring
    expressions, which put seconds *first*, end with (``0 0 12 * * *`` is noon there, and every
    second of 00:00 on the 12th here)."""
    if text == "*":
        raise _fail(expr, SECOND_FIELD, "'*' (every second) is not supported: croniter reads the 6th field as "
                                        "seconds, Quartz and Spring read the first; write '*/1' for every second, "
                                        "or move the seconds to the end (m h dom mon dow sec)")
    return tuple(sorted(_parse_field(expr, SECOND_FIELD, text)))


def spec_from_sets(
    text: str,
    minutes, hours, days, months, weekdays, *, wildcard: bool, day_rule: DayRule = DayRule.AND
) -> CronSpec:
    """Build a spec from already-expanded sets (Celery's ``crontab``), validating reachability."""
    months_t = tuple(sorted(months))
    days_f = frozenset(days)
    if not (minutes and hours and days_f and months_t and weekdays):
        raise ScheduleError(f"crontab {text}: a field has no values")
    _check_can_fire(text, days_f, months_t, dom_only=True)
    return CronSpec(
        text=text,
        minutes=tuple(sorted(minutes)),
        hours=tuple(sorted(hours)),
        days=days_f,
        months=months_t,
        weekdays=frozenset(w % 7 for w in weekdays),
        dom_star=False,
        dow_star=False,
        wildcard=wildcard,
        day_rule=day_rule,
    )
