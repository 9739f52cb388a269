"""``cluster_beat_*`` settings: defaults, every problem reported at once, and the lease's
Redis client built from exactly the options that were validated. Pure: no server is reached."""
from __future__ import annotations

import os

import pytest
from celery import Celery

from celery_cluster_beat.config import CatchupPolicy, OverlapPolicy, load_settings
from celery_cluster_beat.config.settings import DEFAULT_DB_URL, default_db_url
from celery_cluster_beat.errors import ConfigError


def conf(**settings):
    app = Celery("settings-test", broker=settings.pop("broker_url", "memory://"))
    app.conf.update(settings)
    return app.conf


def test_defaults_without_a_redis_broker_mean_sqlite_claims_and_no_lease():
    s = load_settings(conf(), has_result_backend=lambda: False)
    assert s.db_url == DEFAULT_DB_URL
    assert s.redis_url is None and s.redis is None
    assert (s.lock_ttl, s.claim_grace, s.max_run_time, s.jitter) == (5.0, 10.0, 600.0, 0.0)
    assert s.catchup is CatchupPolicy.LATEST and s.catchup_window is None and s.catchup_max == 100
    assert s.overlap is OverlapPolicy.ALLOW, "without a result backend nothing can be guarded"


def test_with_a_result_backend_the_default_overlap_policy_is_skip():
    assert load_settings(conf(), has_result_backend=lambda: True).overlap is OverlapPolicy.SKIP


def test_a_redis_broker_is_the_lease_redis_with_the_broker_transport_options():
    c = conf(broker_url="sentinel://127.0.0.1:26379", broker_transport_options={"master_name": "mymaster"},
             cluster_beat_lock_ttl=3)
    s = load_settings(c, has_result_backend=lambda: False)
    assert s.redis_url == "sentinel://127.0.0.1:26379"
    assert s.redis.transport_options == {"master_name": "mymaster"}
    assert s.redis.socket_timeout == 1.5, "half the ttl when that is below 2 s"


def test_what_is_validated_is_what_the_lease_builds():
    """A Sentinel broker without master_name fails at start-up, not at the first lease call."""
    with pytest.raises(ConfigError, match="cluster_beat_redis_url"):
        load_settings(conf(broker_url="sentinel://127.0.0.1:26379"), has_result_backend=lambda: False)


def test_an_explicit_redis_url_other_than_the_broker_does_not_take_the_broker_options():
    c = conf(broker_url="redis://127.0.0.1:6379/0", broker_transport_options={"client_name": "x"},
             cluster_beat_redis_url="redis://127.0.0.1:6379/5")
    s = load_settings(c, has_result_backend=lambda: False)
    assert s.redis_url.endswith("/5") and dict(s.redis.transport_options) == {}


def test_an_empty_redis_url_turns_the_lease_off_even_with_a_redis_broker():
    s = load_settings(conf(broker_url="redis://127.0.0.1:6379/0", cluster_beat_redis_url=""),
                      has_result_backend=lambda: False)
    assert s.redis_url is None and s.redis is None


def test_every_bad_setting_is_reported_in_one_error_naming_it():
    c = conf(cluster_beat_db_url="nonsense", cluster_beat_lock_ttl=0.1, cluster_beat_catchup="sometimes",
             cluster_beat_catchup_window=-1, cluster_beat_catchup_max=0, cluster_beat_overlap="never",
             cluster_beat_max_run_time="long", cluster_beat_jitter=-2, cluster_beat_claim_grace=True,
             cluster_beat_node_id="n" * 300, timezone="Mars/Olympus")
    with pytest.raises(ConfigError) as info:
        load_settings(c, has_result_backend=lambda: True)
    named = " ".join(info.value.problems)
    for setting in ("cluster_beat_db_url", "cluster_beat_lock_ttl", "cluster_beat_catchup:",
                    "cluster_beat_catchup_window", "cluster_beat_catchup_max", "cluster_beat_overlap",
                    "cluster_beat_max_run_time", "cluster_beat_jitter", "cluster_beat_claim_grace",
                    "cluster_beat_node_id", "timezone"):
        assert f"setting {setting}" in named, setting
    assert len(info.value.problems) == 11
    assert str(info.value).startswith("11 problems")


@pytest.mark.parametrize("setting, value, reason", [
    ("cluster_beat_catchup_window", float("inf"), "expected a finite number of seconds"),
    ("cluster_beat_max_run_time", 1e300, "must be at most 3153600000 s (100 years)"),
    ("cluster_beat_claim_retention", 10 ** 5000, "must be at most"),
    ("cluster_beat_lock_ttl", float("nan"), "expected a number of seconds"),
    ("cluster_beat_catchup_max", 10 ** 9, "expected a whole number from 1 to 100000"),
    ("cluster_beat_node_id", "node\x00a", "control character"),
    ("cluster_beat_http_port", 10 ** 5000, "expected a port number"),
], ids=lambda v: v if isinstance(v, str) and v.startswith("cluster_beat_") else "")
def test_a_number_or_name_out_of_range_is_refused_naming_the_setting(setting, value, reason):
    """Issue 19, item 7: every duration is finite and within what beat's date arithmetic holds,
    every name within what its column holds; the message names the setting and the reason."""
    with pytest.raises(ConfigError) as info:
        load_settings(conf(**{setting: value}), has_result_backend=lambda: False)
    (problem,) = info.value.problems
    assert problem.startswith(f"setting {setting}: ") and reason in problem, problem


def test_zero_jitter_is_allowed_and_zero_grace_is_not():
    load_settings(conf(cluster_beat_jitter=0), has_result_backend=lambda: False)
    with pytest.raises(ConfigError, match="cluster_beat_claim_grace: must be positive"):
        load_settings(conf(cluster_beat_claim_grace=0), has_result_backend=lambda: False)


def test_a_password_in_a_url_never_shows_in_the_settings_repr():
    c = conf(cluster_beat_db_url="postgresql+psycopg://u:s3cret@db/x",
             cluster_beat_redis_url="redis://:hunter2@127.0.0.1:6379/0")
    text = repr(load_settings(c, has_result_backend=lambda: False))
    assert "s3cret" not in text and "hunter2" not in text


# --------------------------------------------------------------------------- Celery's own settings


def test_beat_cron_starting_deadline_is_the_default_catchup_window():
    """Celery's bound on late cron runs becomes the catch-up window when ours is unset."""
    s = load_settings(conf(beat_cron_starting_deadline=300), has_result_backend=lambda: False)
    assert s.catchup_window == 300.0


def test_an_explicit_catchup_window_wins_over_beat_cron_starting_deadline():
    s = load_settings(conf(beat_cron_starting_deadline=300, cluster_beat_catchup_window=60),
                      has_result_backend=lambda: False)
    assert s.catchup_window == 60.0


@pytest.mark.parametrize("bad", [-1, 0, "soon", True])
def test_a_bad_beat_cron_starting_deadline_is_reported_naming_it(bad):
    """The same seconds check as cluster_beat_catchup_window, naming Celery's setting."""
    with pytest.raises(ConfigError) as info:
        load_settings(conf(beat_cron_starting_deadline=bad), has_result_backend=lambda: False)
    assert info.value.problems == [info.value.problems[0]]
    assert info.value.problems[0].startswith("setting beat_cron_starting_deadline: ")


def test_celery_default_schedule_file_keeps_the_historic_claim_file():
    """Neither -s nor beat_schedule_filename (or Celery's default for either): celerybeat-cluster.sqlite3."""
    assert default_db_url(conf()) == DEFAULT_DB_URL == "sqlite:///celerybeat-cluster.sqlite3"
    assert default_db_url(conf(), "celerybeat-schedule") == DEFAULT_DB_URL
    assert default_db_url(conf(), os.path.abspath("celerybeat-schedule")) == DEFAULT_DB_URL
    assert default_db_url(conf(beat_schedule_filename="./celerybeat-schedule")) == DEFAULT_DB_URL
    assert default_db_url(conf(beat_schedule_filename=None)) == DEFAULT_DB_URL


def test_another_schedule_file_names_the_claim_file_beside_it(tmp_path):
    """``F`` -> ``sqlite:///<F made absolute>-cluster.sqlite3``; -s wins over the conf."""
    sched = tmp_path / "beat" / "schedule.db"
    assert default_db_url(conf(beat_schedule_filename=str(sched))) == f"sqlite:///{sched}-cluster.sqlite3"
    assert default_db_url(conf(beat_schedule_filename=sched)) == f"sqlite:///{sched}-cluster.sqlite3"  # a Path
    assert default_db_url(conf(beat_schedule_filename="elsewhere"), str(sched)) == f"sqlite:///{sched}-cluster.sqlite3"
    relative = default_db_url(conf(beat_schedule_filename="var/beat-schedule"))
    assert relative == f"sqlite:///{os.path.abspath('var/beat-schedule')}-cluster.sqlite3"
    assert relative.startswith("sqlite:////"), "absolute: the log says exactly which file"


def test_load_settings_takes_beat_s_and_an_explicit_db_url_wins(tmp_path):
    sched = str(tmp_path / "s")
    s = load_settings(conf(), has_result_backend=lambda: False, schedule_filename=sched)
    assert s.db_url == f"sqlite:///{sched}-cluster.sqlite3"
    s = load_settings(conf(cluster_beat_db_url="sqlite:///x.sqlite3"), has_result_backend=lambda: False,
                      schedule_filename=sched)
    assert s.db_url == "sqlite:///x.sqlite3"
    s = load_settings(conf(beat_schedule_filename=sched), has_result_backend=lambda: False)
    assert s.db_url == f"sqlite:///{sched}-cluster.sqlite3"


@pytest.mark.parametrize("bad, named", [
    ({"beat_schedule_filename": 42}, "setting beat_schedule_filename:"),
    ({"beat_schedule_filename": "/tmp/what?mode=ro"}, "setting beat_schedule_filename:"),
    ({"beat_schedule_filename": "/tmp/100%"}, "setting beat_schedule_filename:"),
])
def test_a_schedule_file_that_cannot_name_a_sqlite_file_is_reported(bad, named):
    with pytest.raises(ConfigError) as info:
        load_settings(conf(**bad), has_result_backend=lambda: False)
    assert len(info.value.problems) == 1 and info.value.problems[0].startswith(named), info.value.problems
    assert "cluster_beat_db_url" in info.value.problems[0] or "file path" in info.value.problems[0]


def test_a_bad_beat_s_is_reported_naming_it():
    with pytest.raises(ConfigError, match=r"setting schedule_filename \(celery beat -s\)"):
        load_settings(conf(), has_result_backend=lambda: False, schedule_filename="/tmp/a?b")


def test_without_enable_utc_and_timezone_the_zone_is_the_local_one():
    """Celery's rule; the local zone here is whatever the host has (the subprocess tests set TZ)."""
    from celery import Celery

    from celery_cluster_beat.schedules.celery_types import app_zone, local_zone
    from celery_cluster_beat.schedules.instants import UTC

    app = Celery("zone-test", broker="memory://")
    app.conf.update(enable_utc=False)
    load_settings(app.conf, has_result_backend=lambda: False)
    assert app_zone(app) is local_zone()
    app.conf.update(enable_utc=True)
    assert app_zone(app) is UTC
