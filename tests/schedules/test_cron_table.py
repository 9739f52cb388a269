"""The reference table of ``cron(expr, tz).next_fire(after)``: UTC in, UTC out.

Each row pins one rule of the schedule semantics (DST rules apply in the
schedule's time zone):

* a *fixed* job (neither the minute nor the hour field text starts with ``*``)
  whose wall time is skipped by a spring-forward runs once, at the first instant
  after the gap; in a repeated (fall-back) hour it runs once, in the first pass;
* a *wildcard* job runs only at wall times that exist, and in both passes of a
  repeated hour;
* Vixie's day rule: both day fields restricted -> a day matches if EITHER does,
  otherwise both must match (a field starting with ``*``, such as ``*/2``, counts
  as unrestricted).
"""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest

from celery_cluster_beat import cron


def utc(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(timezone.utc)


# expr, tz, after, expected next_fire, the rule the row pins
TABLE = [
    ("30 2 * * *", "America/New_York", "2026-03-07T12:00Z", "2026-03-08T07:00Z",
     "fixed 02:30 skipped by spring-forward runs at the gap's end, 03:00 EDT"),
    ("30 * * * *", "America/New_York", "2026-03-08T06:45Z", "2026-03-08T07:30Z",
     "wildcard job does not make up the skipped 02:30; next is 03:30 EDT"),
    ("*/30 2 * * *", "America/New_York", "2026-03-08T05:00Z", "2026-03-09T06:00Z",
     "'*/30 2' is wildcard: the whole 02:xx hour is skipped on spring-forward day"),
    ("0 */2 * * *", "America/New_York", "2026-03-08T05:03Z", "2026-03-08T08:00Z",
     "wildcard hour '*/2': 02:00 does not exist, next is 04:00 EDT"),
    ("30 1 * * *", "America/New_York", "2026-11-01T05:30Z", "2026-11-02T06:30Z",
     "fixed 01:30 ran in the first pass (EDT); not again at 01:30 EST"),
    ("30 * * * *", "America/New_York", "2026-11-01T05:30Z", "2026-11-01T06:30Z",
     "wildcard job runs in the second pass of the repeated hour too"),
    ("0 1-3 * * *", "America/New_York", "2026-11-01T05:00Z", "2026-11-01T07:00Z",
     "fixed 01:00 not repeated at 01:00 EST; next is 02:00 EST"),
    ("30 1 * * *", "Europe/London", "2026-10-25T00:30Z", "2026-10-26T01:30Z",
     "fixed 01:30 runs once, in the first (BST) pass"),
    ("15 2 * * *", "Australia/Lord_Howe", "2026-10-03T00:00Z", "2026-10-03T15:30Z",
     "30-minute spring-forward 02:00->02:30 skips 02:15: runs at the gap's end"),
    ("45 1 * * *", "Australia/Lord_Howe", "2026-04-04T14:45Z", "2026-04-05T15:15Z",
     "30-minute fall-back repeats 01:30-01:59: fixed 01:45 not repeated"),
    ("0 0 * * *", "America/Santiago", "2026-09-05T12:00Z", "2026-09-06T04:00Z",
     "midnight spring-forward: 00:00 does not exist, runs at 01:00 -03"),
    ("0 0 13 * 5", "UTC", "2026-01-10T00:00Z", "2026-01-13T00:00Z",
     "OR rule: the 13th (a Tuesday) matches although it is not a Friday"),
    ("0 0 */2 * 1", "UTC", "2026-01-01T00:00Z", "2026-01-05T00:00Z",
     "'*/2' day-of-month counts as '*': AND rule, odd day AND Monday (Jan 3 excluded)"),
    ("0 0 * * 1-1", "UTC", "2026-01-01T00:00Z", "2026-01-05T00:00Z",
     "'1-1' means 1 (Monday)"),
    ("0 0 29 2 *", "UTC", "2096-02-29T00:00Z", "2104-02-29T00:00Z",
     "Feb 29 only in leap years; 2100 is not one"),
    ("@monthly", "Europe/London", "2026-03-15T00:00Z", "2026-03-31T23:00Z",
     "@monthly is 00:00 on the 1st in the schedule's tz (BST: 23:00Z the day before)"),
]


@pytest.mark.parametrize(
    "expr, tz, after, expected, rule",
    TABLE,
    ids=[f"{e}|{tz}|{a}" for e, tz, a, _, _ in TABLE],
)
def test_next_fire_matches_reference_table(expr, tz, after, expected, rule):
    """next_fire(after) is the table's instant (see `rule` for why)."""
    got = cron(expr, tz=tz).next_fire(utc(after))
    assert got == utc(expected), f"{expr!r} in {tz} after {after}: {rule}; got {got.isoformat()}"
    assert got.utcoffset() == timedelta(0)


@pytest.mark.parametrize(
    "expr, tz, after, expected, rule",
    TABLE,
    ids=[f"{e}|{tz}|{a}" for e, tz, a, _, _ in TABLE],
)
def test_fires_between_agrees_with_table(expr, tz, after, expected, rule):
    """fires_between(after, expected) ends with the table's instant and has nothing before it."""
    assert cron(expr, tz=tz).fires_between(utc(after), utc(expected)) == [utc(expected)]


# --- the API contract every row relies on -------------------------------------------

def test_next_fire_returns_aware_datetime_in_datetime_timezone_utc():
    """The result's tzinfo is datetime.timezone.utc, whatever the schedule's tz."""
    got = cron("30 2 * * *", tz="America/New_York").next_fire(utc("2026-06-01T00:00Z"))
    assert got.tzinfo is timezone.utc
    assert got == utc("2026-06-01T06:30Z")


def test_next_fire_is_strictly_after():
    """An `after` equal to a scheduled instant yields the following one."""
    s = cron("*/15 * * * *", tz="UTC")
    assert s.next_fire(utc("2026-06-01T10:15Z")) == utc("2026-06-01T10:30Z")
    assert s.next_fire(utc("2026-06-01T10:14:59.999999Z")) == utc("2026-06-01T10:15Z")


def test_after_in_another_zone_is_the_same_instant():
    """`after` may carry any tzinfo; only the instant matters."""
    from zoneinfo import ZoneInfo

    s = cron("0 12 * * *", tz="Europe/Berlin")
    after_tokyo = datetime(2026, 6, 1, 20, 0, tzinfo=ZoneInfo("Asia/Tokyo"))  # 11:00Z
    assert s.next_fire(after_tokyo) == utc("2026-06-02T10:00Z")


def test_naive_after_is_rejected_with_value_error():
    """A naive `after` is ambiguous, so it raises ValueError."""
    s = cron("0 0 * * *", tz="UTC")
    with pytest.raises(ValueError):
        s.next_fire(datetime(2026, 1, 1))
    with pytest.raises(ValueError):
        s.fires_between(datetime(2026, 1, 1), datetime(2026, 1, 2))


def test_fires_between_is_half_open_start_excluded_end_included():
    """fires_between(start, end) is (start, end], ascending."""
    s = cron("0 * * * *", tz="UTC")
    assert s.fires_between(utc("2026-06-01T10:00Z"), utc("2026-06-01T13:00Z")) == [
        utc("2026-06-01T11:00Z"), utc("2026-06-01T12:00Z"), utc("2026-06-01T13:00Z")]
    assert s.fires_between(utc("2026-06-01T10:00Z"), utc("2026-06-01T10:59Z")) == []
