"""croniter's own ``get_next`` cases (``croniter_cases.tsv``, from croniter 7.0.0's test suite, MIT):
we accept them and fire at croniter's instants, except for differences the README documents.

Every case falls in exactly one bucket, and the buckets' sizes are pinned (a change shows):

* ``options``: cases run with a croniter option ``cron()`` does not offer (``hash_id``,
  ``day_or=False``, ``second_at_beginning``, ``expand_from_start_time``, ``implement_cron_bug``);
* ``refused``: syntax we refuse on purpose, each with a documented reason;
* ``agree``: accepted, and ``next_fire(start)`` is croniter's answer;
* documented differences, accepted but answered otherwise:
  ``equal range`` (``7-7``, ``Sun-Sun``: croniter reads an equal-bound range as the whole field,
  Vixie and we as the one value), ``day rule`` (a day field starting with ``*``: Vixie's AND,
  croniter's OR; croniter's own ``implement_cron_bug=True`` gives our answer), ``dst`` (a
  transition lies between the start and the answers: our Vixie wall-time rules apply).
"""
from __future__ import annotations

import collections
import re
from datetime import datetime, timezone
from pathlib import Path
from zoneinfo import ZoneInfo

from croniter import croniter

from celery_cluster_beat import ScheduleError, cron

UTC = timezone.utc
CASES = Path(__file__).with_name("croniter_cases.tsv")

#: Why we refuse what croniter accepts (each a pattern of our message).
REFUSALS = {
    "quartz seconds": r"'\*' \(every second\) is not supported",
    "year field": r"a year field is not supported",
    "step after a value": r"a step needs '\*' or a range before it",
    "'*' listed with '#'": r"cannot be listed with '#'",
    "'?'": r"'\?' \(no-specific-value\) is not supported",
}
EQUAL_RANGE = re.compile(r"(?:^|[ ,])(\w+)-\1(?:$|[ ,/])|\b(?:7-0|0-7|7-7|0-0)\b", re.IGNORECASE)


def _rows():
    for line in CASES.read_text().splitlines():
        if line and not line.startswith("#"):
            yield line.split("\t")


def _aware(text: str) -> datetime:
    t = datetime.fromisoformat(text)
    return t.replace(tzinfo=UTC) if t.tzinfo is None else t


def _has_transition(tz: str, a: datetime, b: datetime) -> bool:
    zone = ZoneInfo(tz)
    lo, hi = min(a, b), max(a, b)
    return lo.astimezone(zone).utcoffset() != hi.astimezone(zone).utcoffset()


def classify():
    buckets = collections.Counter()
    unexplained = []
    for expr, tz, start_text, expected_text, options in _rows():
        if options != "-":
            buckets["options"] += 1
            continue
        zone = "UTC" if tz == "-" else tz
        try:
            schedule = cron(expr, tz=zone)
        except ScheduleError as exc:
            reason = [name for name, pattern in REFUSALS.items() if re.search(pattern, str(exc))]
            if reason:
                buckets["refused: " + reason[0]] += 1
            else:
                unexplained.append(f"refused {expr!r}: {exc}")
            continue
        start, expected = _aware(start_text), _aware(expected_text)
        got = schedule.next_fire(start)
        if got == expected:
            buckets["agree"] += 1
        elif EQUAL_RANGE.search(expr):
            buckets["differ: equal range"] += 1
        elif croniter(expr, start.astimezone(ZoneInfo(zone)), implement_cron_bug=True).get_next(datetime) == got:
            buckets["differ: day rule"] += 1
        elif tz != "-" and _has_transition(zone, start, max(got, expected)):
            buckets["differ: dst"] += 1
        else:
            unexplained.append(f"{expr!r} in {zone} from {start_text}: croniter {expected_text}, we {got.isoformat()}")
    return buckets, unexplained


def test_croniter_cases_are_accepted_and_agree_except_documented_differences():
    buckets, unexplained = classify()
    assert unexplained == []
    accepted = sum(n for k, n in buckets.items() if k == "agree" or k.startswith("differ"))
    print(f"\ncroniter get_next cases: {sum(buckets.values())}; accepted {accepted}, "
          f"agreeing {buckets['agree']}; " + ", ".join(f"{k} {n}" for k, n in sorted(buckets.items())))
    assert dict(buckets) == {
        "agree": 2296,
        "differ: equal range": 78,
        "differ: day rule": 4,
        "differ: dst": 1,
        "options": 82,
        "refused: quartz seconds": 36,
        "refused: year field": 15,
        "refused: step after a value": 2,
        "refused: '*' listed with '#'": 1,
        "refused: '?'": 1,
    }


def test_the_data_file_says_where_it_comes_from_and_its_licence():
    head = CASES.read_text()[:3000]
    assert "croniter" in head and "MIT" in head and "Matsumoto Taichi" in head
    assert sum(1 for _ in _rows()) == 2516
