"""Names and descriptions are printable text (issue 20, item 7), and operators' output shows
whatever is not as an escape.

:func:`~celery_cluster_beat.config.values.printable_problem` refuses control characters (C0, DEL,
C1), format characters (Unicode category Cf: bidi overrides such as U+202E, zero-width joiners,
the BOM), lone surrogates and the line and paragraph separators; a ``beat_schedule`` entry whose
name, task or description holds one is refused at start-up naming the entry and the field, except
that a description may run over lines, with tabs. The rule is for text that enters: a stored row
read back is held only to what the claim database cannot store (control characters in a name), so
a name valid before the rule (an emoji with a zero-width joiner, Persian with a zero-width
non-joiner) stays readable.
:func:`~celery_cluster_beat.config.values.printable` is the one escape every command-line output
of stored text goes through.
"""
from __future__ import annotations

import pytest

from celery_cluster_beat import ConfigError
from celery_cluster_beat.config import build_entries
from celery_cluster_beat.config.entries import build_entry
from celery_cluster_beat.config.values import printable, printable_problem, text_problem

HOSTILE = [
    ("\x1b[2J", "a control character", "\\x1b[2J"),
    ("a\nb", "a control character", "a\\nb"),
    ("tab\there", "a control character", "tab\\there"),
    ("del\x7f", "a control character", "del\\x7f"),
    ("csi\x9b31m", "a control character", "csi\\x9b31m"),
    ("abc\u202edef", "a format character", "abc\\u202edef"),
    ("zero\u200bwidth", "a format character", "zero\\u200bwidth"),
    ("\ufeffbom", "a format character", "\\ufeffbom"),
    ("tag\U000e0041", "a format character", "tag\\U000e0041"),
    ("line\u2028sep", "a line separator", "line\\u2028sep"),
    ("para\u2029sep", "a paragraph separator", "para\\u2029sep"),
    ("lone\ud800", "a lone surrogate", "lone\\ud800"),
]


@pytest.mark.parametrize("text, kind, escaped", HOSTILE)
def test_unprintable_characters_are_named_and_shown_escaped(text, kind, escaped):
    assert printable(text) == escaped
    problem = printable_problem(text)
    assert problem is not None and problem.startswith(f"contains {kind} (") and problem.endswith("printable text only")


@pytest.mark.parametrize("text", ["plain", "Émilie du Châtelet", "报告 ٣", "nbsp\u00a0and\u3000wide", "😀", ""])
def test_printable_text_is_left_as_it_is(text):
    assert printable(text) == text and printable_problem(text) is None


@pytest.mark.parametrize("field, spec", [
    ("name", None),
    ("task", {"task": "t.\u202ex", "schedule": 10}),
    ("description", {"task": "t", "schedule": 10, "description": "clear\x1b[2J"}),
    ("description", {"task": "t", "schedule": 10, "description": "bell\x07"}),
    ("description", {"task": "t", "schedule": 10, "description": "rev\u202eersed"}),
    ("description", {"task": "t", "schedule": 10, "description": "isolate\u2067d"}),
])
def test_a_beat_schedule_entry_with_unprintable_text_is_refused_naming_the_field(field, spec):
    name = "job\u202e" if spec is None else "job"
    with pytest.raises(ConfigError) as info:
        build_entries({name: spec or {"task": "t", "schedule": 10}})
    (problem,) = info.value.problems
    assert problem.startswith(f"beat_schedule entry {name!r}: {field}: contains "), problem


def test_a_beat_schedule_description_may_run_over_lines_with_tabs():
    """Free text as people write it (lines, tabs, CRLF, emoji sequences, soft hyphens, direction
    marks) stopped beat from starting; only what a terminal acts on or what reorders an operator's
    reading is refused. Output escapes it all."""
    text = "Monthly report.\r\n\tSee the runbook \U0001f468\u200d\U0001f469 soft\u00adly, \u200fmarked."
    entries = build_entries({"job": {"task": "t", "schedule": 10, "description": text}})
    assert entries["job"].description == text
    assert printable(entries["job"].description).startswith("Monthly report.\\r\\n\\tSee the runbook")
    with pytest.raises(ConfigError, match="description: contains a control character \\('\\\\x07' at 5\\)"):
        build_entries({"job": {"task": "t", "schedule": 10, "description": "ring \x07"}})


FORMAT_NAMES = ["family \U0001f468\u200d\U0001f469\u200d\U0001f467", "\u0645\u06cc\u200c\u062e\u0648\u0627\u0647\u0645",
                "soft\u00adhyphen", "rtl\u200fmark"]


@pytest.mark.parametrize("name", FORMAT_NAMES)
def test_a_name_valid_before_the_printable_rule_is_refused_entering_but_read_back_as_it_is(name):
    assert "a format character" in text_problem(name, limit=200)
    assert text_problem(name, limit=200, printable_only=False) is None
    with pytest.raises(ConfigError, match="name: contains a format character"):
        build_entries({name: {"task": "t", "schedule": 10}})
    entry, problems = build_entry(name, {"task": "t", "schedule": 10, "description": "x\u202ey"}, printable_only=False)
    assert problems == [] and entry.name == name
    assert text_problem("bell\x07", limit=200, printable_only=False).startswith("contains a control character")
