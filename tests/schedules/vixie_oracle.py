"""An independent oracle: a minute-by-minute simulation of Vixie cron's main loop.

This module deliberately imports neither ``celery_cluster_beat`` nor ``croniter``.
It parses 5-field cron expressions itself and replays the scheduling loop of
``cron.c`` from ISC/Vixie cron 4.1 (the loop Debian's cron inherited) against a
fake clock that advances *real* (UTC) time one minute at a time and derives the
local wall time from :mod:`zoneinfo`, exactly as ``set_time()`` derives
``clockTime`` from ``time()`` plus ``tm_gmtoff``.

The loop, paraphrased from cron.c::

    timeRunning = virtualTime = clockTime          # all jobs for virtualTime have run
    forever:
        sleep until clockTime != timeRunning;  timeRunning = clockTime
        timeDiff = timeRunning - virtualTime
        if timeDiff == 1:                          # the normal case
            virtualTime = timeRunning; find_jobs(virtualTime, wild=True, fixed=True)
        elif |timeDiff| > 180:                     # "large": clock was set
            virtualTime = timeRunning; find_jobs(timeRunning, wild=True, fixed=True)
        elif timeDiff > 5:                         # "medium": DST began (clock jumped forward)
            find_jobs(timeRunning, wild=True, fixed=False)
            do: virtualTime += 1; find_jobs(virtualTime, wild=False, fixed=True)
            while virtualTime < timeRunning
        elif timeDiff > 0:                         # "small": woke up late, catch up
            do: virtualTime += 1; find_jobs(virtualTime, wild=True, fixed=True)
            while virtualTime < timeRunning
        else:                                      # "negative": DST ended (clock went back)
            find_jobs(timeRunning, wild=True, fixed=False)   # virtualTime stays put
        job_runqueue()

So, for a spring-forward, fixed jobs of the skipped wall minutes run at the first
real minute after the jump and wildcard jobs run only at wall times that exist; for
a fall-back, wildcard jobs run in both passes of the repeated wall times and fixed
jobs only in the first.

A job is *wildcard* when the text of its minute or hour field starts with ``*``
(Vixie's MIN_STAR / HR_STAR flags), otherwise *fixed*. Day matching uses Vixie's
rule: when both day-of-month and day-of-week are restricted (neither field's text
starts with ``*``) a day matches if EITHER matches, otherwise both must match.

Output model: the oracle reports, per job, the real UTC minutes at which the job
is started. Vixie's "medium" loop flushes its run queue between virtual minutes,
so a job matching several skipped wall minutes may be started more than once
within the same real minute; an occurrence is identified by its instant, so the
oracle collapses those into one instant.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import date, datetime, timedelta, timezone
from functools import lru_cache
from zoneinfo import ZoneInfo

__all__ = ["CronJob", "OracleParseError", "parse", "simulate", "fires", "clock_minutes"]

UTC = timezone.utc
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_EPOCH_ORDINAL = date(1970, 1, 1).toordinal()

# (name, lowest, highest) as in Vixie's cron.h; day-of-week accepts 7 as Sunday.
FIELDS = (
    ("minute", 0, 59),
    ("hour", 0, 23),
    ("day-of-month", 1, 31),
    ("month", 1, 12),
    ("day-of-week", 0, 7),
)
MONTH_NAMES = {n: i + 1 for i, n in enumerate(
    ["jan", "feb", "mar", "apr", "may", "jun", "jul", "aug", "sep", "oct", "nov", "dec"])}
DOW_NAMES = {n: i for i, n in enumerate(["sun", "mon", "tue", "wed", "thu", "fri", "sat"])}
SHORTHANDS = {
    "@yearly": "0 0 1 1 *",
    "@annually": "0 0 1 1 *",
    "@monthly": "0 0 1 * *",
    "@weekly": "0 0 * * 0",
    "@daily": "0 0 * * *",
    "@midnight": "0 0 * * *",
    "@hourly": "0 * * * *",
}

# Vixie's thresholds, in minutes.
_LARGE = 3 * 60
_SMALL = 5


class OracleParseError(ValueError):
    pass


@dataclass(frozen=True)
class CronJob:
    expr: str
    minutes: frozenset
    hours: frozenset
    doms: frozenset
    months: frozenset
    dows: frozenset  # 0..6, Sunday = 0
    dom_star: bool
    dow_star: bool
    wildcard: bool = field(default=False)

    def day_matches(self, dom: int, month: int, dow: int) -> bool:
        if month not in self.months:
            return False
        if self.dom_star or self.dow_star:
            return dom in self.doms and dow in self.dows
        return dom in self.doms or dow in self.dows

    def matches(self, minute: int, hour: int, dom: int, month: int, dow: int) -> bool:
        return minute in self.minutes and hour in self.hours and self.day_matches(dom, month, dow)


def _value(text: str, name: str, lo: int, hi: int) -> int:
    names = MONTH_NAMES if name == "month" else DOW_NAMES if name == "day-of-week" else {}
    if text.lower() in names:
        return names[text.lower()]
    if not text.isdigit():
        raise OracleParseError(f"{name}: bad value {text!r}")
    value = int(text)
    if not lo <= value <= hi:
        raise OracleParseError(f"{name}: {value} out of range {lo}-{hi}")
    return value


def _parse_field(text: str, name: str, lo: int, hi: int) -> frozenset:
    values: set[int] = set()
    for term in text.split(","):
        if not term:
            raise OracleParseError(f"{name}: empty term in {text!r}")
        body, slash, step_text = term.partition("/")
        if slash:
            if not step_text.isdigit() or int(step_text) == 0:
                raise OracleParseError(f"{name}: bad step in {term!r}")
            step = int(step_text)
        else:
            step = 1
        if body == "*":
            first, last = lo, hi
        elif "-" in body:
            a, _, b = body.partition("-")
            first, last = _value(a, name, lo, hi), _value(b, name, lo, hi)
            if first > last:
                raise OracleParseError(f"{name}: reversed range {term!r}")
        else:
            if slash:  # Vixie: a step only follows '*' or a range
                raise OracleParseError(f"{name}: step after a single value {term!r}")
            first = last = _value(body, name, lo, hi)
        values.update(range(first, last + 1, step))
    if name == "day-of-week" and 7 in values:
        values.discard(7)
        values.add(0)
    return frozenset(values)


def parse(expr: str) -> CronJob:
    text = SHORTHANDS.get(expr.strip().lower(), expr)
    parts = text.split()
    if len(parts) != 5:
        raise OracleParseError(f"expected 5 fields in {expr!r}")
    sets = [_parse_field(p, n, lo, hi) for p, (n, lo, hi) in zip(parts, FIELDS)]
    return CronJob(
        expr=expr,
        minutes=sets[0],
        hours=sets[1],
        doms=sets[2],
        months=sets[3],
        dows=sets[4],
        dom_star=parts[2].startswith("*"),
        dow_star=parts[4].startswith("*"),
        wildcard=parts[0].startswith("*") or parts[1].startswith("*"),
    )


@lru_cache(maxsize=None)
def _fields_of(vtime: int) -> tuple[int, int, int, int, int]:
    """(minute, hour, dom, month, dow) of a wall-clock minute count (gmtime of vtime*60)."""
    days, rest = divmod(vtime, 1440)
    d = date.fromordinal(_EPOCH_ORDINAL + days)
    return rest % 60, rest // 60, d.day, d.month, (days + 4) % 7  # 1970-01-01 was a Thursday


@lru_cache(maxsize=64)
def clock_minutes(tz: str, start_minute: int, count: int) -> tuple[int, ...]:
    """Vixie's ``clockTime`` (local wall minutes since the epoch) for the real UTC
    minutes ``start_minute .. start_minute + count`` (minutes since the epoch)."""
    zone = ZoneInfo(tz)
    out = []
    for k in range(count + 1):
        at = EPOCH + timedelta(minutes=start_minute + k)
        offset = at.astimezone(zone).utcoffset()
        out.append(start_minute + k + int(offset.total_seconds()) // 60)
    return tuple(out)


def simulate(jobs: list[CronJob], tz: str, start: datetime, end: datetime) -> list[list[datetime]]:
    """Run Vixie's loop from real instant *start* (cron started then, all jobs for
    that minute considered done) to *end*; return, per job, the UTC instants in
    (start, end] at which cron starts it. *start* and *end* must be whole minutes."""
    if start.tzinfo is None or end.tzinfo is None:
        raise ValueError("aware datetimes only")
    s = (start - EPOCH) // timedelta(minutes=1)
    e = (end - EPOCH) // timedelta(minutes=1)
    if EPOCH + timedelta(minutes=s) != start or EPOCH + timedelta(minutes=e) != end:
        raise ValueError("start and end must be whole minutes")
    clocks = clock_minutes(tz, s, e - s)
    runs: list[list[datetime]] = [[] for _ in jobs]

    def find_jobs(vtime: int, do_wild: bool, do_fixed: bool, queue: set) -> None:
        minute, hour, dom, month, dow = _fields_of(vtime)
        for i, job in enumerate(jobs):
            if job.matches(minute, hour, dom, month, dow):
                if (do_fixed and not job.wildcard) or (do_wild and job.wildcard):
                    queue.add(i)

    time_running = virtual_time = clocks[0]
    for k in range(1, len(clocks)):
        clock_time = clocks[k]
        if clock_time == time_running:
            continue
        time_running = clock_time
        queue: set[int] = set()
        diff = time_running - virtual_time
        if diff == 1:
            virtual_time = time_running
            find_jobs(virtual_time, True, True, queue)
        elif diff > _LARGE or diff < -_LARGE:
            virtual_time = time_running
            find_jobs(time_running, True, True, queue)
        elif diff > _SMALL:
            find_jobs(time_running, True, False, queue)
            while True:
                virtual_time += 1
                find_jobs(virtual_time, False, True, queue)
                if not virtual_time < time_running:
                    break
        elif diff > 0:
            while True:
                virtual_time += 1
                find_jobs(virtual_time, True, True, queue)
                if not virtual_time < time_running:
                    break
        else:
            find_jobs(time_running, True, False, queue)
        if queue:
            at = EPOCH + timedelta(minutes=s + k)
            for i in queue:
                runs[i].append(at)
    return runs


def fires(expr: str, tz: str, start: datetime, end: datetime) -> list[datetime]:
    """Instants in (start, end] at which Vixie cron, running in *tz*, starts *expr*."""
    return simulate([parse(expr)], tz, start, end)[0]
