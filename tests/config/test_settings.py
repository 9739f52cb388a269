"""``cluster_beat_*`` settings: defaults, every problem reported at once, and the lease's
Redis client built from exactly the options that were validated. Pure: no server is reached."""
from __future__ import annotations

import pytest
from celery import Celery

from celery_cluster_beat.config import CatchupPolicy, OverlapPolicy, load_settings
from celery_cluster_beat.config.settings import DEFAULT_DB_URL
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


def test_zero_jitter_is_allowed_and_zero_grace_is_not():
    load_settings(conf(cluster_beat_jitter=0), has_result_backend=lambda: False)
    with pytest.raises(ConfigError, match="cluster_beat_claim_grace: must be positive"):
        load_settings(conf(cluster_beat_claim_grace=0), has_result_backend=lambda: False)


def test_a_password_in_a_url_never_shows_in_the_settings_repr():
    c = conf(cluster_beat_db_url="postgresql+psycopg://u:s3cret@db/x",
             cluster_beat_redis_url="redis://:hunter2@127.0.0.1:6379/0")
    text = repr(load_settings(c, has_result_backend=lambda: False))
    assert "s3cret" not in text and "hunter2" not in text
