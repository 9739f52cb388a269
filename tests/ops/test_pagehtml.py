"""The status page's one place a value becomes HTML: escaped, and bounded in length, so a stored
description of a megabyte (written past the API) cannot make every page of it megabytes."""
from __future__ import annotations

from celery_cluster_beat.ops.pagehtml import MAX_SHOWN, _text


def test_a_long_value_is_cut_and_counted_and_still_escaped():
    shown = _text("<" * 1_000_000)
    assert shown.startswith("&lt;" * MAX_SHOWN) and shown.endswith("… (1,000,000 characters)")
    assert "<" not in shown and len(shown) < 5 * MAX_SHOWN


def test_a_value_up_to_the_bound_is_shown_whole():
    assert _text("a:b:c@d " * 10) == "a:b:c@d " * 10  # escaped, never masked
    assert _text("x" * MAX_SHOWN) == "x" * MAX_SHOWN
