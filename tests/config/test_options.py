"""What a schedule's options may ask of Celery's send, by who wrote the schedule (config/options.py).

A ``beat_schedule`` entry is the operator's, trusted like the rest of the Celery config: a
reserved protocol header or a link option in it is sent as configured, and said once at start-up
in one WARNING naming the entry and the fields. The allow-list for stored schedules is read from
``cluster_beat_stored_options_allowed``, checked with the other settings (tests/dynamic/
test_stored_options.py shows it at work).
"""
from __future__ import annotations

import logging

import pytest
from celery import Celery

from celery_cluster_beat import ConfigError, every
from celery_cluster_beat.beat.scheduler import Scheduler
from celery_cluster_beat.config import build_entries, load_settings
from celery_cluster_beat.config.options import (OPT_IN_OPTIONS, STORED_OPTIONS, stored_option_problems,
                                                trusted_option_warnings)


def _settings(**conf):
    app = Celery("options", set_as_current=False)
    app.conf.update(cluster_beat_redis_url="", **conf)
    return load_settings(app.conf, has_result_backend=lambda: False)


def test_the_setting_names_options_a_stored_schedule_may_set_beyond_the_defaults():
    assert _settings().stored_options_allowed == frozenset()
    assert _settings(cluster_beat_stored_options_allowed=["serializer", "link"]).stored_options_allowed == {
        "serializer", "link"}
    with pytest.raises(ConfigError, match="setting cluster_beat_stored_options_allowed: 'task' is not an option"):
        _settings(cluster_beat_stored_options_allowed=("task",))


def test_no_option_is_both_allowed_by_default_and_opt_in():
    assert not set(STORED_OPTIONS) & set(OPT_IN_OPTIONS)


def test_what_is_refused_is_never_among_the_options_kept_for_sending():
    safe, problems = stored_option_problems({"queue": "q", "link": {"task": "x"}, "priority": 300,
                                             "headers": {"tenant": "a", "task": "t.other", "cluster_beat_node": "n"}})
    assert safe == {"queue": "q", "headers": {"tenant": "a"}}
    assert sorted(field for field, _ in problems) == ["options.headers.cluster_beat_node", "options.headers.task",
                                                     "options.link", "options.priority"]


def test_a_config_entry_with_a_reserved_header_or_a_link_is_warned_about_once_at_start_up_and_kept(tmp_path, caplog):
    app = Celery("trusted", set_as_current=False)
    app.conf.update(cluster_beat_db_url=f"sqlite:///{tmp_path}/c.sqlite3", cluster_beat_redis_url="",
                    beat_schedule={
                        "forging": {"task": "t.a", "schedule": every(60),
                                    "options": {"headers": {"task": "t.b", "cluster_beat_node": "x"},
                                                "link": {"task": "t.c"}}},
                        "plain": {"task": "t.a", "schedule": every(60),
                                  "options": {"queue": "q", "serializer": "json", "headers": {"tenant": "x"}}},
                    })
    with caplog.at_level(logging.WARNING, logger="celery_cluster_beat"):
        sched = Scheduler(app=app)
    try:
        lines = [r.getMessage() for r in caplog.records if "sent as configured" in r.getMessage()]
        assert lines == ["cluster-beat: beat_schedule entry 'forging': options.headers.task, "
                         "options.headers.cluster_beat_node, options.link: sent as configured, though it can change "
                         "which task runs or its identity (a stored schedule may not set it)"]
        assert sched.entries["forging"].options["headers"] == {"task": "t.b", "cluster_beat_node": "x"}
    finally:
        sched.close()


def test_the_warning_lines_are_computed_from_the_entries_alone():
    entries = build_entries({"a": {"task": "t", "schedule": 5, "options": {"link_error": {"task": "t.e"}}},
                             "b": {"task": "t", "schedule": 5, "options": {"headers": {"id": "x"}}},
                             "c": {"task": "t", "schedule": 5, "options": {"link": None}}})
    assert [line.split(":")[0] for line in trusted_option_warnings(entries.values())] == [
        "beat_schedule entry 'a'", "beat_schedule entry 'b'"]
