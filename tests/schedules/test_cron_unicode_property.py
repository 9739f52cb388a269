"""Any text given as a cron expression gives a schedule or a ``ScheduleError`` naming the
field (or the whole expression), never another exception type.

Hypothesis feeds the parser arbitrary Unicode: digits of other scripts (``int('٣')`` is 3
in Python, but cron is ASCII), superscripts (``'²'.isdigit()`` is True, ``int('²')``
raises), control characters, Unicode spaces, very long text, and mixtures of these with
valid fields. Both the public ``cron(text)`` and the lower-level ``parse_cron`` are checked.
"""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from celery_cluster_beat import ScheduleError, cron
from celery_cluster_beat.schedules.cronexpr import FIELD_NAMES, MAX_CRON_LENGTH, CronSpec, parse_cron

#: A message names one of the five fields, or "expression" when the problem is the whole text.
NAMED = FIELD_NAMES + ("expression",)

VALID_FIELDS = {
    "minute": ["0", "*", "*/15", "1-30/5", "5,10", "59"],
    "hour": ["0", "*", "9-17", "*/2", "23"],
    "day-of-month": ["1", "*", "13", "1-15", "*/10"],
    "month": ["*", "1", "jan", "FEB-mar", "*/3"],
    "day-of-week": ["*", "0", "7", "mon-fri", "SAT,sun"],
}

#: Characters that look like cron to a careless parser: other scripts' digits (Nd),
#: superscripts and fractions (No), control characters (Cc), Unicode spaces (Zs, Zl, Zp).
TRICKY = st.characters(categories=["Nd", "No", "Nl", "Cc", "Cf", "Zs", "Zl", "Zp"])
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=60)  # all of Unicode, surrogates included
CRONISH = st.lists(st.sampled_from(list("0123456789*,-/ \t@LW#?") + ["jan", "mon", "999999"]),
                   max_size=30).map("".join)


def check(expr: str) -> None:
    """The contract, for one text, through both entry points."""
    for parse in (parse_cron, lambda text: cron(text, tz="UTC").spec):
        try:
            spec = parse(expr)
        except ScheduleError as exc:
            message = str(exc)
            assert message.startswith("cron "), message
            assert any(name in message for name in NAMED), f"no field or 'expression' named in {message!r}"
            assert len(message) < 2 * MAX_CRON_LENGTH + 500, "the message stays readable"
        else:  # accepted: a real schedule, built from ASCII only
            assert isinstance(spec, CronSpec)
            assert expr.isascii(), f"non-ASCII text {expr!r} was accepted"
            assert spec.minutes and spec.hours and spec.days and spec.months and spec.weekdays


@st.composite
def mixed(draw) -> str:
    """Five fields, each valid, tricky or arbitrary, joined by ASCII or Unicode blanks."""
    parts = []
    for name in FIELD_NAMES:
        kind = draw(st.sampled_from(["valid", "valid", "tricky", "spliced", "any"]))
        valid = draw(st.sampled_from(VALID_FIELDS[name]))
        if kind == "valid":
            parts.append(valid)
        elif kind == "tricky":
            parts.append(draw(st.text(TRICKY, min_size=1, max_size=4)))
        elif kind == "spliced":  # a tricky character inside an otherwise valid field
            at = draw(st.integers(0, len(valid)))
            parts.append(valid[:at] + draw(TRICKY) + valid[at:])
        else:
            parts.append(draw(ANY_TEXT))
    separator = draw(st.sampled_from([" ", "\t", "  ", "\u00a0", "\u2003", "\u3000", "\x1c", "\x85"]))
    return separator.join(parts)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ANY_TEXT)
@example("٣ * * * *")  # ARABIC-INDIC DIGIT THREE: int() reads it as 3
@example("0 ٩ * * *")
@example("² * * * *")  # SUPERSCRIPT TWO: isdigit() but int() raises ValueError
@example("*/² * * * *")
@example("0 0 ½ * *")
@example("0 0 * Ⅻ *")  # ROMAN NUMERAL TWELVE (Nl)
@example("0\x000 * * *")
@example("0 0 * * 1\x7f")
@example("0\u00a00 * * *")  # a no-break space is not a field separator
@example("@hourly\x00")
@example("@ｈｏｕｒｌｙ")  # fullwidth letters
@example("")
def test_any_unicode_text(expr):
    check(expr)


@settings(max_examples=400, deadline=None)
@given(mixed())
def test_valid_fields_mixed_with_tricky_characters(expr):
    check(expr)


@settings(max_examples=300, deadline=None)
@given(CRONISH)
def test_cron_like_ascii_text(expr):
    check(expr)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.data_too_large])
@given(st.integers(MAX_CRON_LENGTH + 1, 20_000), st.sampled_from(["9", "*", "٣", "0 ", "\x00", "1,"]))
def test_very_long_text_is_refused_up_front(length, unit):
    expr = (unit * length)[:length]
    check(expr)
    with pytest.raises(ScheduleError, match=f"too long.*at most {MAX_CRON_LENGTH}"):
        parse_cron(expr)


@pytest.mark.parametrize("expr, field", [
    ("٣ * * * *", "minute"), ("0 ٣ * * *", "hour"), ("0 0 ٣ * *", "day-of-month"),
    ("0 0 * ٣ *", "month"), ("0 0 * * ٣", "day-of-week"), ("*/² * * * *", "minute"),
    ("0 0 * * 1\x1b", "day-of-week"), ("@daily\t\x01", "expression"),
])
def test_non_ascii_digits_and_control_characters_name_the_field(expr, field):
    """'٣' would be 3 to ``int``; cron is ASCII, so it is refused, naming field and code point."""
    with pytest.raises(ScheduleError) as info:
        cron(expr, tz="UTC")
    message = str(info.value)
    assert f"cron {expr!r}: {field} " in message, message
    assert "U+" in message


def test_ten_thousand_characters_are_refused_without_quoting_them_all():
    expr = "1," * 5000
    with pytest.raises(ScheduleError) as info:
        cron(expr)
    message = str(info.value)
    assert "10000 characters" in message and "expression" in message and len(message) < 200


def test_the_longest_accepted_expression_still_parses():
    expr = "0" * (MAX_CRON_LENGTH - len(" * * * *") - 1) + "5 * * * *"
    assert len(expr) == MAX_CRON_LENGTH
    assert parse_cron(expr).minutes == (5,)
