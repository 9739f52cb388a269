"""Extended cron (issue 22, item 3): ``L``, ``W``, ``#``, wrapping ranges and croniter's sixth
(seconds) field, with our wall-time and DST rules.

* ``L`` / ``W`` / ``#`` / ``L<n>`` only choose *days*: a fixed time on such a day follows the
  fixed-job rules (a skipped wall time fires once at the gap end, a repeated one in the first
  pass), a wildcard time the wildcard rules (nothing made up, both passes);
* a seconds field: the job is *wildcard* when its second, minute or hour field starts with
  ``*`` (it repeats within the minute, as ``*/15`` does within the hour), else *fixed*;
* wrapping ranges are plain value sets (as croniter expands them), so the plain rules apply.

Each table row is checked against the instant worked out by hand; the rows away from DST
transitions are also checked against croniter itself (``implement_cron_bug=True``: croniter's
Vixie day rule, ours).
"""
from __future__ import annotations

from datetime import datetime, timedelta, timezone
from zoneinfo import ZoneInfo

import pytest
from croniter import croniter

from celery_cluster_beat import ScheduleError, cron
from celery_cluster_beat.schedules.cronexpr import parse_cron

UTC = timezone.utc


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)


# expr, tz, after, expected next_fire, why
AWAY_FROM_DST = [
    ("0 0 L * *", "UTC", "2026-01-31T00:00Z", "2026-02-28T00:00Z", "L: last day of February"),
    ("0 0 L 2 *", "UTC", "2027-03-01T00:00Z", "2028-02-29T00:00Z", "L: a leap February ends on the 29th"),
    ("0 0 1,L * *", "UTC", "2026-04-01T00:00Z", "2026-04-30T00:00Z", "L listed with a day"),
    ("0 0 29-L * *", "UTC", "2026-01-31T00:00Z", "2026-03-29T00:00Z", "29-L: February 2026 has no 29th"),
    ("0 0 L * 5", "UTC", "2026-01-30T00:00Z", "2026-01-31T00:00Z", "L or Friday (Vixie OR): Sat 31st"),
    ("0 0 L * */2", "UTC", "2026-01-01T00:00Z", "2026-01-31T00:00Z", "'*/2' dow: AND, the 31st is a Saturday"),
    ("0 9 15W * *", "UTC", "2026-02-01T00:00Z", "2026-02-16T09:00Z", "W: Sun 15th -> Mon 16th"),
    ("0 9 15W * *", "UTC", "2026-08-01T00:00Z", "2026-08-14T09:00Z", "W: Sat 15th -> Fri 14th"),
    ("0 9 1W * *", "UTC", "2026-07-31T00:00Z", "2026-08-03T09:00Z", "W: Sat 1st -> Mon 3rd, never the month before"),
    ("0 9 31W * *", "UTC", "2026-05-01T00:00Z", "2026-05-29T09:00Z", "W: Sun 31st -> Fri 29th, never the month after"),
    ("0 9 31W * *", "UTC", "2026-04-01T00:00Z", "2026-04-30T09:00Z", "W: 31W in April is the 30th first"),
    ("0 9 15W * 1", "UTC", "2026-01-01T00:00Z", "2026-01-15T09:00Z", "W with plain dow: the W day decides (croniter)"),
    ("0 0 * * 1#3", "UTC", "2026-01-01T00:00Z", "2026-01-19T00:00Z", "#: third Monday"),
    ("0 0 * * 1#5", "UTC", "2026-01-01T00:00Z", "2026-03-30T00:00Z", "#5: only months with five Mondays"),
    ("0 0 * * 7#1", "UTC", "2026-01-01T00:00Z", "2026-01-04T00:00Z", "#: 7 is Sunday"),
    ("0 0 * * mon-wed#2", "UTC", "2026-01-12T00:00Z", "2026-01-13T00:00Z", "#: a name range, the second Tuesday"),
    ("0 0 * * L5", "UTC", "2026-01-01T00:00Z", "2026-01-30T00:00Z", "L5: last Friday"),
    ("0 0 * * L2,L4", "UTC", "2026-01-28T00:00Z", "2026-01-29T00:00Z", "L2,L4: last Tuesday and Thursday"),
    ("0 0 13 * fri#2", "UTC", "2026-01-01T00:00Z", "2026-01-09T00:00Z", "#: the nth weekday decides (croniter)"),
    ("30 23 1-7 JAN MON-FRI#1", "UTC", "2026-01-02T23:30Z", "2026-01-05T23:30Z", "croniter's test_issue_k33"),
    ("0 0 */2 * L5", "UTC", "2026-01-01T00:00Z", "2026-02-27T00:00Z", "'*/2' dom: AND, Jan 30 is even"),
    ("0 9 15W * 1#3", "UTC", "2026-01-01T00:00Z", "2026-02-16T09:00Z", "W and #: both must hold"),
    ("0 22-2 * * *", "UTC", "2026-01-01T02:00Z", "2026-01-01T22:00Z", "wrapping hours"),
    ("0 0 * * fri-mon", "UTC", "2026-01-05T00:00Z", "2026-01-09T00:00Z", "wrapping weekdays: Tue-Thu skipped"),
    ("0 0 1 nov-feb *", "UTC", "2026-02-01T00:00Z", "2026-11-01T00:00Z", "wrapping months"),
    ("0 0 * * Thu-Tue/2", "UTC", "2024-01-06T00:00Z", "2024-01-09T00:00Z", "croniter's step over a wrap: Tue, not Mon"),
    ("30 2 * * * 15,45", "UTC", "2026-01-01T02:30:15Z", "2026-01-01T02:30:45Z", "seconds field"),
    ("* 0 * * * */20", "UTC", "2026-01-01T00:00:40Z", "2026-01-01T00:01:00Z", "seconds: */20 rolls into the next minute"),
    ("0 0 L * *", "Asia/Tokyo", "2026-01-31T00:00Z", "2026-02-27T15:00Z", "L in a zone without DST"),
    ("0 9 * * 1#3", "America/New_York", "2026-06-01T00:00Z", "2026-06-15T13:00Z", "# in a DST zone, in summer"),
]

# Around DST transitions: our rules, not croniter's (no croniter check).
AT_DST = [
    ("30 2 * * L0", "Europe/Berlin", "2026-03-28T12:00Z", "2026-03-29T01:00Z",
     "L<n> picks the spring-forward Sunday; fixed 02:30 is skipped: once at the gap end, 03:00 CEST"),
    ("*/30 2 * * L0", "Europe/Berlin", "2026-03-28T12:00Z", "2026-04-26T00:00Z",
     "wildcard on the same day: nothing made up; next is the last Sunday of April"),
    ("30 2 * * L0", "Europe/Berlin", "2026-10-25T00:30Z", "2026-11-29T01:30Z",
     "fall-back Sunday: fixed 02:30 ran in the first pass (00:30Z) only"),
    ("*/30 2 * * L0", "Europe/Berlin", "2026-10-25T00:30Z", "2026-10-25T01:00Z",
     "wildcard: 02:00 CET, the second pass, fires too"),
    ("30 2 * * 0#2", "America/New_York", "2026-03-07T12:00Z", "2026-03-08T07:00Z",
     "#: the second Sunday of March is spring-forward day: gap end"),
    ("30 2 27W 3 *", "Asia/Jerusalem", "2026-03-26T12:00Z", "2026-03-27T00:00Z",
     "W picks Friday the 27th, Israel's spring-forward day: gap end 03:00 IDT"),
    ("30 2 L * 5", "Asia/Jerusalem", "2026-03-26T12:00Z", "2026-03-27T00:00Z",
     "L or Friday: the Friday is spring-forward day: gap end"),
    ("30 23 29W 10 *", "Africa/Cairo", "2026-10-29T20:30Z", "2027-10-29T21:30Z",
     "W picks Thursday the 29th, whose 23:xx repeats: fixed, first pass only (20:30Z), then next October"),
    ("*/30 23 29W 10 *", "Africa/Cairo", "2026-10-29T20:30Z", "2026-10-29T21:00Z",
     "wildcard W job: the second pass (23:00 EET) fires too"),
    ("30 2 * * * 15", "America/New_York", "2026-03-07T12:00Z", "2026-03-08T07:00Z",
     "seconds, fixed: 02:30:15 is skipped: once at the gap end"),
    ("30 2 * * * 0,30", "America/New_York", "2026-03-08T07:00Z", "2026-03-09T06:30Z",
     "seconds, fixed: both skipped seconds collapse into the one gap-end instant"),
    ("*/30 2 * * * 0", "America/New_York", "2026-03-08T05:00Z", "2026-03-09T06:00Z",
     "seconds with a '*' minute: wildcard, the skipped hour is not made up"),
    ("30 1 * * * 0,30", "America/New_York", "2026-11-01T05:30:30Z", "2026-11-02T06:30Z",
     "seconds, fixed: the repeated 01:30 fires in the first pass only"),
    ("30 1 * * * */30", "America/New_York", "2026-11-01T05:30:30Z", "2026-11-01T06:30Z",
     "'*/30' seconds: wildcard, the second pass fires too"),
    ("30 22-2 * * *", "America/New_York", "2026-03-08T06:30Z", "2026-03-08T07:00Z",
     "wrapping hours are plain values: fixed 02:30 at the gap end"),
]


@pytest.mark.parametrize("expr, tz, after, expected, why", AWAY_FROM_DST + AT_DST,
                         ids=[f"{r[0]}|{r[1]}|{r[2]}" for r in AWAY_FROM_DST + AT_DST])
def test_next_fire(expr, tz, after, expected, why):
    schedule = cron(expr, tz=tz)
    got = schedule.next_fire(utc(after))
    assert got == utc(expected), f"{expr!r} in {tz} after {after}: {why}; got {got.isoformat()}"
    assert schedule.fires_between(utc(after), utc(expected)) == [utc(expected)], why


@pytest.mark.parametrize("expr, tz, after, expected, why", AWAY_FROM_DST,
                         ids=[f"{r[0]}|{r[1]}|{r[2]}" for r in AWAY_FROM_DST])
def test_croniter_agrees_away_from_dst(expr, tz, after, expected, why):
    start = utc(after).astimezone(ZoneInfo(tz))
    theirs = croniter(expr, start, implement_cron_bug=True).get_next(datetime)
    assert theirs == utc(expected), f"croniter: {theirs.isoformat()} ({why})"


def test_a_walk_through_a_dst_day_with_seconds_matches_the_rules():
    """Every fire of a seconds job over the New York fall-back night: both passes of 01:xx, every 20 s."""
    schedule = cron("*/30 1 * * * */20", tz="America/New_York")
    got = schedule.fires_between(utc("2026-11-01T05:00Z"), utc("2026-11-01T07:00Z"))
    first = [utc("2026-11-01T05:00Z") + timedelta(minutes=m, seconds=s) for m in (0, 30) for s in (0, 20, 40)]
    expected = [t for t in first + [t + timedelta(hours=1) for t in first] if t > utc("2026-11-01T05:00Z")]
    assert got == expected


@pytest.mark.parametrize("expr", ["0 0 L * *", "0 0 * * 1#3", "0 0 15W * *", "0 0 * * * 30"])
def test_extended_specs_say_so(expr):
    """Callers describing a rule by its value sets must use the text instead (``spec.extended``)."""
    assert parse_cron(expr).extended
    assert not parse_cron("0 22-2 * * fri-mon").extended  # wraps are plain value sets


# --- what stays refused ------------------------------------------------------------------

REFUSED = [
    ("0 0 * * 5L", "day-of-week", "'L5'"),  # Quartz's last Friday: croniter writes L5
    ("0 0 LW * *", "day-of-month", "not supported"),
    ("0 0 L-3 * *", "day-of-month", "not supported"),
    ("0 0 1W,15 * *", "day-of-month", "single day"),
    ("0 0 32W * *", "day-of-month", "out of range"),
    ("0 0 * * 1#6", "day-of-week", "1-5"),
    ("0 0 * * 1#3,2", "day-of-week", "cannot be listed"),
    ("0 0 * * *,sat#3", "day-of-week", "cannot be listed"),
    ("0 0 * * L", "day-of-week", "'L5'"),
    ("0 0 * * 1-3#2", "day-of-week", "not accepted"),  # croniter takes name ranges only before '#'
    ("0 0 15 * fri#2", "day-of-month", "never"),  # a second Friday is never the 15th
    ("0 0 15W * 0", "day-of-month", "never"),  # a W day is never a Sunday
    ("0 0 1-1,L * *", "day-of-month", "croniter"),  # croniter reads 1-1 as the whole month
    ("0 0 * * 7-0", "day-of-week", "ambiguous"),
    ("0 0 * * * *", "second", "Quartz"),  # Spring's hourly: a bare '*' sixth field
    ("0 0 12 * * *", "second", "Quartz"),
    ("0 0 9 * * MON-FRI", "second", "MON-FRI"),
    ("0 0 * * * 60", "second", "0-59"),
    ("0 0 * * * 0 2026", "expression", "year"),
    ("H * * * *", "minute", "hash"),
    ("R * * * *", "minute", "random"),
    ("0 0 ? * *", "day-of-month", "not supported"),
]


@pytest.mark.parametrize("expr, field, words", REFUSED, ids=[r[0] for r in REFUSED])
def test_refused_naming_the_field_and_the_reason(expr, field, words):
    with pytest.raises(ScheduleError) as info:
        cron(expr, tz="UTC")
    message = str(info.value)
    assert message.startswith(f"cron {expr!r}: "), message
    if field != "expression":
        assert f": {field}" in message, message
    assert words.lower() in message.lower(), message


def test_plain_expressions_never_load_croniter():
    """Only an expression using L/W/# imports croniter; Vixie ones keep the package's own parser."""
    import subprocess
    import sys

    code = ("import sys; from celery_cluster_beat.schedules.cronexpr import parse_cron; "
            "parse_cron('*/5 22-2 * * fri-mon'); parse_cron('0 0 * * * 30'); a = 'croniter' in sys.modules; "
            "parse_cron('0 0 L * *'); print(a, 'croniter' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["False", "True"]
