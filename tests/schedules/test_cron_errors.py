"""Bad cron input is refused when the schedule is built, with a message an operator can act on.

Every error is a ``ScheduleError`` (a ``ValueError``); its message quotes the
expression as ``cron '<expr>'``, names the field (minute, hour, day-of-month,
month, day-of-week) and says what is wrong. The tests check key words, not whole
sentences, except for one exact example.

Valid edge cases (OR rule, leap days, names in any case, 7 = Sunday, shorthands)
must be accepted and fire as specified.
"""
from __future__ import annotations

import re
from datetime import datetime, timezone

import pytest

from celery_cluster_beat import ScheduleError, cron

UTC = timezone.utc


def utc(*args) -> datetime:
    return datetime(*args, tzinfo=UTC)


def error_of(expr: str, tz: str = "UTC") -> str:
    with pytest.raises(ScheduleError) as info:
        cron(expr, tz=tz)
    assert isinstance(info.value, ValueError)
    message = str(info.value)
    assert f"cron '{expr}'" in message, f"message does not quote the expression: {message!r}"
    return message


def assert_any(message: str, *words: str) -> None:
    low = message.lower()
    assert any(w.lower() in low for w in words), f"none of {words} in {message!r}"


def test_schedule_error_is_a_value_error():
    """Callers guarding configuration with `except ValueError` keep working."""
    assert issubclass(ScheduleError, ValueError)


# --- field count ------------------------------------------------------------------

def test_four_fields_is_refused_saying_five_are_needed():
    """A 4-field expression names the count it got and the 5 it needs."""
    message = error_of("0 0 * *")
    assert_any(message, "field")
    assert "5" in message and "4" in message


@pytest.mark.parametrize("expr", ["0 0 0 * * *", "0 0 0 * * * 2026", "*/5 * * * * *"])
def test_six_or_seven_fields_are_refused_as_seconds_or_year_not_supported(expr):
    """Year fields and Quartz's seconds-first order (a bare '*' sixth field) are not supported; the
    message says so. (croniter's sixth field, seconds last, is accepted since issue 22.)"""
    message = error_of(expr)
    assert_any(message, "not supported")
    assert_any(message, "second", "year")


# --- per-field errors: (expression, field named, words of which one must appear) -------

FIELD_ERRORS = [
    # empty terms
    ("1,,2 * * * *", "minute", ["empty"]),
    ("0 1, * * *", "hour", ["empty"]),
    ("0 0 1,15, * *", "day-of-month", ["empty"]),
    # not numbers
    ("abc * * * *", "minute", ["abc"]),
    ("0 noon * * *", "hour", ["noon"]),
    ("0 0 * foo *", "month", ["foo"]),
    ("0 0 * * funday", "day-of-week", ["funday"]),
    # out of range
    ("60 * * * *", "minute", ["range", "0-59"]),
    ("0 24 * * *", "hour", ["range", "0-23"]),
    ("0 0 0 * *", "day-of-month", ["range", "1-31"]),
    ("0 0 32 * *", "day-of-month", ["range", "1-31"]),
    ("0 0 * 13 *", "month", ["range", "1-12"]),
    ("0 0 * 0 *", "month", ["range", "1-12"]),
    ("0 0 * * 8", "day-of-week", ["range", "0-7", "0-6"]),
    ("0-60 * * * *", "minute", ["range", "0-59"]),
    # steps
    ("*/0 * * * *", "minute", ["step"]),
    ("0 1-10/0 * * *", "hour", ["step"]),
    ("*/99 * * * *", "minute", ["step"]),
    ("*/60 * * * *", "minute", ["step"]),
    ("0 */24 * * *", "hour", ["step"]),
    ("0 0 */31 * *", "day-of-month", ["step"]),
    ("0 0 1 */12 *", "month", ["step"]),
    # reversed ranges wrap (issue 22, as croniter: '22-2' is 22,23,0,1,2); an ambiguous one is refused
    ("0 0 * * 7-0", "day-of-week", ["ambiguous"]),
    # not Vixie syntax
    ("5/15 * * * *", "minute", ["step", "not supported", "vixie", "'*'", "range"]),
    # Quartz / Jenkins extensions croniter does not read as Quartz does (L, W, # themselves are
    # accepted since issue 22: tests/schedules/test_cron_extensions.py), or outside the day fields
    ("0 0 L-3 * *", "day-of-month", ["not supported"]),
    ("0 0 LW * *", "day-of-month", ["not supported"]),
    ("0 L * * *", "hour", ["not supported"]),
    ("0 0 * 15W *", "month", ["not supported"]),
    ("0 0 ? * *", "day-of-month", ["not supported"]),
    ("5#3 0 * * *", "minute", ["not supported"]),
    ("0 0 * * 5L", "day-of-week", ["not supported"]),
    ("0 0 * * ?", "day-of-week", ["not supported"]),
    ("H * * * *", "minute", ["not supported"]),
    ("0 H * * *", "hour", ["not supported"]),
]


@pytest.mark.parametrize("expr, field, reasons", FIELD_ERRORS, ids=[e for e, _, _ in FIELD_ERRORS])
def test_bad_field_is_refused_naming_expression_field_and_reason(expr, field, reasons):
    """The message quotes the expression, names the offending field and gives the reason."""
    message = error_of(expr)
    # 'month' must appear on its own, not only inside 'day-of-month'
    assert re.search(rf"(?<!day-of-){re.escape(field)}", message), f"field {field!r} not named in {message!r}"
    assert_any(message, *reasons)


@pytest.mark.parametrize("expr", ["5/15 * * * *", "*/99 * * * *"])
def test_message_repeats_the_offending_term(expr):
    """Besides quoting the whole expression, the message points at the bad term."""
    term = expr.split()[0]
    message = error_of(expr)
    assert message.count(term) >= 2, message


@pytest.mark.parametrize("expr", ["*/59 * * * *", "0 */23 * * *", "0 0 */30 * *", "0 0 1 */11 *",
                                  "0-59/30 * * * *", "1-30/5 * * * *"])
def test_steps_smaller_than_the_field_are_accepted(expr):
    """The largest legal step is one less than the number of values in the field."""
    cron(expr, tz="UTC")


def test_star_59_fires_at_minutes_0_and_59():
    """'*/59' in minute is {0, 59}."""
    got = cron("*/59 * * * *", tz="UTC").fires_between(utc(2026, 6, 1, 0, 0), utc(2026, 6, 1, 2, 0))
    assert got == [utc(2026, 6, 1, 0, 59), utc(2026, 6, 1, 1, 0), utc(2026, 6, 1, 1, 59), utc(2026, 6, 1, 2, 0)]


@pytest.mark.parametrize("expr", ["@reboot", "@every 5m", "@every"])
def test_reboot_and_every_shorthands_are_not_supported(expr):
    """@reboot has no instant and @every is not cron; both are refused as not supported."""
    message = error_of(expr)
    assert_any(message, "not supported")
    assert expr.split()[0] in message


def test_unknown_shorthand_is_refused():
    """A misspelt shorthand is an error, not silently something else."""
    message = error_of("@dayly")
    assert "@dayly" in message


# --- expressions that can never fire ------------------------------------------------------

def test_february_30th_message_is_exact():
    """The one message checked word for word."""
    with pytest.raises(ScheduleError) as info:
        cron("0 0 30 2 *", tz="UTC")
    assert str(info.value) == "cron '0 0 30 2 *': day-of-month 30 never occurs in February"


def test_31st_of_thirty_day_months_never_occurs():
    """The message names the day and every month it does not occur in."""
    message = error_of("0 0 31 4,6,9,11 *")
    assert "day-of-month" in message and "31" in message
    assert_any(message, "never")
    for month in ("April", "June", "September", "November"):
        assert month in message, message


def test_february_30th_and_31st_never_occur():
    """Several impossible days in one month are refused too."""
    message = error_of("0 0 30,31 2 *")
    assert_any(message, "never")
    assert "February" in message


# --- unknown time zones ----------------------------------------------------------------

@pytest.mark.parametrize("tz", ["Mars/Olympus_Mons", "America/NewYork", "EST5EDT6"])
def test_unknown_time_zone_is_refused_naming_it(tz):
    """The zone name is repeated so the operator sees the typo."""
    message = error_of("0 0 * * *", tz=tz)
    assert tz in message
    assert_any(message, "time zone", "timezone", "tz")


# --- valid edge inputs ------------------------------------------------------------------

def test_feb_29_or_monday_is_valid_under_the_or_rule():
    """'0 12 29 2 1' fires on Feb 29 (leap years) and on every Monday of February."""
    s = cron("0 12 29 2 1", tz="UTC")
    got = s.fires_between(utc(2027, 12, 31), utc(2028, 12, 31))
    assert got == [utc(2028, 2, d, 12) for d in (7, 14, 21, 28, 29)]  # 2028-02-29 is a Tuesday
    assert s.next_fire(utc(2026, 1, 1)) == utc(2026, 2, 2, 12)  # first Monday of Feb 2026


def test_feb_29_fires_only_in_leap_years():
    """'0 0 29 2 *' is valid and fires every leap year."""
    s = cron("0 0 29 2 *", tz="UTC")
    assert s.next_fire(utc(2026, 1, 1)) == utc(2028, 2, 29)
    assert s.next_fire(utc(2028, 2, 29)) == utc(2032, 2, 29)


def _same_fires(a: str, b: str, start=utc(2025, 12, 1), end=utc(2026, 5, 1)) -> None:
    got_a = cron(a, tz="UTC").fires_between(start, end)
    got_b = cron(b, tz="UTC").fires_between(start, end)
    assert got_a == got_b, f"{a!r} and {b!r} differ"
    assert got_a, f"{a!r} never fired in the test window"


@pytest.mark.parametrize("named, numeric", [
    ("0 0 1 jan *", "0 0 1 1 *"),
    ("0 0 1 JAN *", "0 0 1 1 *"),
    ("0 0 1 Feb-Mar *", "0 0 1 2-3 *"),
    ("0 0 1 jan,MAR *", "0 0 1 1,3 *"),
    ("0 0 * * MON", "0 0 * * 1"),
    ("0 0 * * mon", "0 0 * * 1"),
    ("0 0 * * Mon-Fri", "0 0 * * 1-5"),
    ("0 0 * * mon-fri", "0 0 * * 1-5"),
    ("0 0 * * SAT,sun", "0 0 * * 6,0"),
])
def test_month_and_weekday_names_in_any_case(named, numeric):
    """Names are case-insensitive and mean the same as the numbers."""
    _same_fires(named, numeric)


@pytest.mark.parametrize("sunday", ["0 0 * * 7", "0 0 * * sun", "0 0 * * SUN"])
def test_seven_and_zero_are_both_sunday(sunday):
    """Day-of-week 7 is Sunday, like 0."""
    _same_fires(sunday, "0 0 * * 0")
    assert cron(sunday, tz="UTC").next_fire(utc(2026, 1, 1)) == utc(2026, 1, 4)  # a Sunday


def test_range_ending_on_seven_includes_sunday():
    """'5-7' is Friday, Saturday, Sunday."""
    _same_fires("0 0 * * 5-7", "0 0 * * 0,5,6")


@pytest.mark.parametrize("shorthand, expr", [
    ("@hourly", "0 * * * *"),
    ("@daily", "0 0 * * *"),
    ("@midnight", "0 0 * * *"),
    ("@weekly", "0 0 * * 0"),
    ("@monthly", "0 0 1 * *"),
])
def test_shorthands_mean_their_five_field_form(shorthand, expr):
    """Each shorthand fires like its 5-field equivalent."""
    _same_fires(shorthand, expr)


@pytest.mark.parametrize("shorthand", ["@yearly", "@annually"])
def test_yearly_shorthands_fire_on_new_year(shorthand):
    """@yearly and @annually fire at 00:00 on January 1st."""
    s = cron(shorthand, tz="UTC")
    assert s.fires_between(utc(2026, 1, 1), utc(2029, 1, 1)) == [utc(2027, 1, 1), utc(2028, 1, 1), utc(2029, 1, 1)]


def test_one_to_one_range_means_one():
    """'1-1' is the single value 1."""
    _same_fires("1-1 1-1 * * *", "1 1 * * *")


def test_extra_whitespace_between_fields_is_accepted():
    """Fields are separated by any run of blanks, as in a crontab file."""
    _same_fires("0   12 *\t* *", "0 12 * * *")
