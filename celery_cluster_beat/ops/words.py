"""Rules, durations and instants as an operator reads them: "At 02:30, Monday through Friday
(Europe/Paris)", "every 6 hours from 02:30", "in 3 min", "1 h 12 min".

Shared by the command line and the dashboard so both say the same thing. Cron phrasing comes
from ``cron-descriptor`` (a maintained library, translated and tested) rather than from
hand-written rules; we only adapt what differs in our semantics: Celery's ``crontab`` joins a
restricted day-of-month and day-of-week with AND, Vixie cron with OR (which cron-descriptor
already says). Nothing here does I/O; a rule that cannot be phrased falls back to its text
form, never to an exception, because these strings decorate reports and must not break them.
"""
from __future__ import annotations

from datetime import datetime, timezone
from decimal import Decimal
from functools import lru_cache
from typing import Any, Iterable, Optional, Sequence, Tuple

#: (seconds, singular word, short unit) from the largest down: the interval phrasing picks the
#: largest unit that divides the step exactly ("every 90 minutes", never "every 1.5 hours").
_UNITS: Tuple[Tuple[int, str, str], ...] = ((86400, "day", "d"), (3600, "hour", "h"), (60, "minute", "min"),
                                            (1, "second", "s"))

#: Field bounds of a 5-field expression, for the compact form of a converted Celery crontab.
_BOUNDS = ((0, 59), (0, 23), (1, 31), (1, 12), (0, 6))


def _plural(n: Any, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def interval_words(step_seconds: float) -> str:
    """``6 hours``, ``90 minutes``, ``1.5 seconds``: the largest whole unit, else seconds."""
    micros = int(round(Decimal(str(step_seconds)) * 1_000_000))
    for size, word, _ in _UNITS:
        if micros % (size * 1_000_000) == 0:
            return _plural(micros // (size * 1_000_000), word)
    return _plural(f"{(Decimal(micros) / 1_000_000).normalize():f}", "second")


def duration(seconds: Optional[float]) -> str:
    """A duration in human units with two parts at most: ``850 ms``, ``4.2 s``, ``3 min 5 s``,
    ``2 h 10 min``, ``3 d 4 h``; ``-`` for None."""
    if seconds is None:
        return "-"
    sign = "-" if seconds < 0 else ""
    s = abs(float(seconds))
    if s < 1:
        return f"{sign}{s * 1000:.0f} ms"
    if s < 60:
        return f"{sign}{s:.1f} s" if s < 10 else f"{sign}{s:.0f} s"
    whole = int(round(s))
    parts = []
    for size, _, short in _UNITS:
        if whole >= size or (parts and len(parts) < 2):
            parts.append((whole // size, short))
            whole %= size
        if len(parts) == 2:
            break
    text = " ".join(f"{n} {u}" for n, u in parts if n or u == parts[0][1])
    return sign + text


def relative(at: Optional[datetime], now: datetime) -> str:
    """``in 3 min`` / ``12 s ago`` / ``now`` (within half a second); ``-`` for None."""
    if at is None:
        return "-"
    delta = (at - now).total_seconds()
    if abs(delta) < 0.5:
        return "now"
    return f"in {duration(delta)}" if delta > 0 else f"{duration(-delta)} ago"


def _ranges(values: Sequence[int], lo: int, hi: int) -> str:
    vals = sorted(set(values))
    if vals == list(range(lo, hi + 1)):
        return "*"
    if len(vals) > 2 and vals[0] == lo:
        step = vals[1] - vals[0]
        if step > 1 and vals == list(range(lo, hi + 1, step)):
            return f"*/{step}"
    out, start, prev = [], vals[0], vals[0]
    for v in vals[1:] + [None]:
        if v is not None and v == prev + 1:
            prev = v
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if v is not None:
            start = prev = v
    return ",".join(out)


def cron_fields(spec: Any) -> str:
    """The 5-field text of a cron spec's value sets: a converted Celery ``crontab`` (whose own
    text is an 85-character repr) reads ``0 4 * * *``."""
    sets: Iterable[Iterable[int]] = (spec.minutes, spec.hours, spec.days, spec.months, spec.weekdays)
    return " ".join(_ranges(list(s), lo, hi) for s, (lo, hi) in zip(sets, _BOUNDS))


def _minute_text(at: datetime) -> str:
    """An instant as operators read it: ``2026-12-07 15:00Z`` (seconds only when not zero)."""
    at = at.astimezone(timezone.utc)
    return at.strftime("%Y-%m-%d %H:%M:%S" if at.second or at.microsecond else "%Y-%m-%d %H:%M") + "Z"


def bounds_words(start_at: Optional[datetime], end_at: Optional[datetime], max_runs: Optional[int]) -> str:
    """``from 2026-12-07 15:00Z, until 2026-12-31 00:00Z, at most 2 runs``; empty without bounds."""
    parts = []
    if start_at is not None:
        parts.append(f"from {_minute_text(start_at)}")
    if end_at is not None:
        parts.append(f"until {_minute_text(end_at)}")
    if max_runs is not None:
        parts.append(f"at most {_plural(max_runs, 'run')}")
    return ", ".join(parts)


def compact(schedule: Any) -> str:
    """A rule's short text: cron fields, ``every 6h from 02:30``, or ``at 2026-12-07T15:00:00Z``;
    falls back to ``repr``."""
    instant, wall = getattr(schedule, "instant", None), getattr(schedule, "wall", None)
    if instant is not None:
        return "at " + instant.astimezone(timezone.utc).replace(tzinfo=None).isoformat() + "Z"
    if wall is not None:
        return "at " + wall.isoformat()
    spec = getattr(schedule, "spec", None)
    if spec is not None:
        text = getattr(spec, "text", None)
        return text if isinstance(text, str) and not text.startswith("crontab(") else cron_fields(spec)
    step_us = getattr(schedule, "step_us", None)
    if step_us is not None:
        text = "every " + _short_interval(step_us / 1_000_000)
        baseline = getattr(schedule, "baseline", None)
        return f"{text} from {baseline}" if baseline else text
    return repr(schedule)


def _short_interval(step_seconds: float) -> str:
    words = interval_words(step_seconds)
    n, word = words.split(" ", 1)
    for _, long, short in _UNITS:
        if word.rstrip("s") == long:
            return f"{n}{short}" if short != "min" else f"{n}min"
    return f"{n}s"  # pragma: no cover


def _cron_words(spec: Any) -> str:
    if getattr(spec, "extended", False):  # L, W, #, seconds: the value sets do not say them; show the text
        raise ValueError("described by its text")
    restricted = not (spec.dom_star or spec.dow_star)
    return _phrase(cron_fields(spec), restricted and getattr(spec.day_rule, "value", spec.day_rule) == "and")


@lru_cache(maxsize=4096)
def _phrase(fields: str, and_rule: bool) -> str:
    """cron-descriptor's phrase of *fields*, kept: it loads its translations for every expression
    (about 0.3 ms), and ``list`` or a page phrase the same few rules over and over."""
    from cron_descriptor import ExpressionDescriptor, Options

    options = Options()
    options.use_24hour_time_format = True
    options.verbose = False
    options.throw_exception_on_parse_error = True
    text = ExpressionDescriptor(fields, options).get_description()
    if and_rule:
        text = text.replace(", or on ", ", and only on ")  # Celery's crontab: both must match
    return text


def rule_words(schedule: Any, zone: Optional[str] = None) -> str:
    """The rule in words with its zone: ``At 02:30, Monday through Friday (Europe/Paris)``,
    ``every 6 hours from 02:30 (UTC)``, ``every 30 seconds``; the compact text when it cannot be
    phrased. *zone*: the zone the rule runs in (a plain interval has none: it is zone-free)."""
    try:
        spec = getattr(schedule, "spec", None)
        if spec is not None:
            text = _cron_words(spec)
        elif getattr(schedule, "instant", None) is not None:  # a one-off at an exact instant: no zone
            return "once, at " + _minute_text(schedule.instant)
        elif getattr(schedule, "wall", None) is not None:  # a one-off at a wall time in its zone
            wall = schedule.wall
            text = "once, at " + wall.strftime("%Y-%m-%d %H:%M:%S" if wall.second or wall.microsecond else "%Y-%m-%d %H:%M")
        elif getattr(schedule, "step_us", None) is not None:
            text = "every " + interval_words(schedule.step_us / 1_000_000)
            if text.startswith("every 1 "):  # "every minute", not "every 1 minute"
                text = "every " + text[len("every 1 "):]
            if getattr(schedule, "baseline", None):
                text += f" from {schedule.baseline}"
            else:
                zone = None
        else:
            return compact(schedule)
    except Exception:  # noqa: BLE001 - phrasing is decoration: fall back to the exact text
        text = compact(schedule)
        if getattr(schedule, "spec", None) is None:
            return text
    return f"{text} ({zone})" if zone else text
