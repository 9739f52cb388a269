"""Rules, durations and instants in words (:mod:`celery_cluster_beat.ops.words`): what ``list``,
``status`` and the dashboard say. Pure functions: no store, no Celery app."""
from __future__ import annotations

from datetime import datetime, timedelta, timezone

import pytest
from celery.schedules import crontab

from celery_cluster_beat import cron, every
from celery_cluster_beat.ops import words
from celery_cluster_beat.schedules.celery_types import as_schedule

UTC = timezone.utc


@pytest.mark.parametrize("rule, zone, text", [
    (cron("30 2 * * 1-5"), "Europe/Paris", "At 02:30, Monday through Friday (Europe/Paris)"),
    (cron("0 4 * * *"), "UTC", "At 04:00 (UTC)"),
    (every(timedelta(hours=6), baseline="02:30"), "UTC", "every 6 hours from 02:30 (UTC)"),
    (every(30), None, "every 30 seconds"),
    (every(30), "Europe/Paris", "every 30 seconds"),  # a plain interval is zone-free: no zone shown
    (every(60), None, "every minute"),
    (every(5400), None, "every 90 minutes"),
    (every(1.5), None, "every 1.5 seconds"),
])
def test_rules_in_words(rule, zone, text):
    assert words.rule_words(rule, zone) == text


def test_celery_crontab_reads_as_cron_fields_never_its_repr():
    converted = as_schedule(crontab("0", "4", "*"))  # what Celery's celery.backend_cleanup becomes
    assert "crontab(" in repr(converted)  # its own text is the 85-character repr
    assert words.compact(converted) == "0 4 * * *"
    assert words.rule_words(converted, "UTC") == "At 04:00 (UTC)"
    assert words.compact(as_schedule(crontab(minute="*/15", hour="9-17", day_of_week="1-5"))) == "*/15 9-17 * * 1-5"


def test_compact_forms():
    assert words.compact(cron("30 2 * * 1-5")) == "30 2 * * 1-5"
    assert words.compact(every(timedelta(hours=6), baseline="02:30")) == "every 6h from 02:30"
    assert words.compact(every(90)) == "every 90s"
    assert words.compact(every(120)) == "every 2min"


@pytest.mark.parametrize("seconds, text", [
    (None, "-"), (0.377, "377 ms"), (3.24, "3.2 s"), (42, "42 s"), (61, "1 min 1 s"), (3600, "1 h"),
    (7260, "2 h 1 min"), (90000, "1 d 1 h"), (-5, "-5.0 s"),
])
def test_durations(seconds, text):
    assert words.duration(seconds) == text


def test_relative_instants():
    now = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
    assert words.relative(now + timedelta(minutes=3), now) == "in 3 min"
    assert words.relative(now - timedelta(seconds=12), now) == "12 s ago"
    assert words.relative(now + timedelta(milliseconds=200), now) == "now"
    assert words.relative(None, now) == "-"


def test_a_rule_that_cannot_be_phrased_falls_back_to_its_text():
    class Odd:
        spec = None
        step_us = None

        def __repr__(self) -> str:
            return "<odd rule>"

    assert words.rule_words(Odd(), "UTC") == "<odd rule>"


@pytest.mark.parametrize("expr", ["0 0 L * *", "0 9 * * 1#3", "0 9 * * L5", "0 9 15W * *", "30 2 * * * 15"])
def test_extended_cron_is_shown_as_its_exact_text_with_its_zone_never_misphrased(expr):
    # cron-descriptor reads five plain fields: "0 0 L * *" phrased from the value sets would say
    # "At 00:00", every day. The exact text is the truth an operator can read.
    from celery_cluster_beat.schedules import cron

    assert words.rule_words(cron(expr), "Europe/Paris") == f"{expr} (Europe/Paris)"
    assert words.compact(cron(expr)) == expr


def test_a_wrapping_range_is_phrased_from_its_values():
    from celery_cluster_beat.schedules import cron

    text = words.rule_words(cron("30 22-2 * * *"), "UTC")
    assert "22:00" in text and "02:59" in text and text.endswith("(UTC)"), text
