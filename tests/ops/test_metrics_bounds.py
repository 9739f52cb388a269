"""``/metrics`` stays bounded whatever the number of schedules, forgets what goes, and keeps its names.

* Unit level (the metrics object fed through the package's signals, as beat feeds it):
  100,000 stored schedules that fired give an exposition of a bounded size, and 100,000 more
  after those were removed do not grow it; the totals count every occurrence all the same.
  Config entries always have a ``schedule`` label value of their own; stored schedules take at
  most ``cluster_beat_metrics_stored_max`` slots, in the order they report, until they go; every
  other schedule is counted under ``schedule=""`` (no schedule has an empty name). The names
  and labels are those of the release before the bound, so existing alerts keep matching.
* A real Scheduler in this process (claims in SQLite, the Redis broker, its HTTP server on a
  free port): a stored schedule removed at run time loses its series on ``/metrics``; the
  config entry keeps its own, and the totals keep counting both.
"""
from __future__ import annotations

import time
import urllib.request
import uuid
from datetime import datetime, timedelta, timezone
from typing import List, Tuple
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from celery import Celery

from celery_cluster_beat import every, signals
from celery_cluster_beat.ops.metrics import DEFAULT_STORED_MAX, OVERFLOW, ClusterBeatMetrics
from test_metrics_http import Samples, parse, value

FIXED = datetime(2026, 1, 1, tzinfo=timezone.utc)
#: Bytes of the exposition with every slot taken by a short name (500 stored schedules and two
#: config entries sent, one late observation each: a 20-line histogram a schedule): measured about
#: 0.9 MB; the one-series-per-schedule exposition was 180 MB for 100,000 schedules.
BOUND = 1_500_000
#: The worst case: every slot taken by a name of the longest length (255), each with three outcomes,
#: a watchdog fire and the histogram: measured about 4.6 MB.
WORST_BOUND = 6_000_000
#: Series of the schedule label (what the bound is about).
LABELLED = ("cluster_beat_occurrences_total", "cluster_beat_send_lateness_seconds_count",
            "cluster_beat_send_lateness_seconds_bucket", "cluster_beat_watchdog_fired_total", "cluster_beat_runs_total")


def schedules_with_series(samples: Samples) -> set:
    """Label values of schedules counted under their own name."""
    return {lab["schedule"] for name in LABELLED for lab, _ in samples.get(name, [])
            if lab.get("schedule", OVERFLOW) != OVERFLOW}


def send(sender: object, names, outcome: str = "sent") -> None:
    for name in names:
        signals.occurrence_handled.send(sender=sender, outcome=outcome, schedule=name,
                                        scheduled_at=FIXED - timedelta(seconds=0.05), task_id="t", reason=None)


@pytest.fixture
def metrics():
    made: List[ClusterBeatMetrics] = []

    def make(**kwargs) -> Tuple[ClusterBeatMetrics, object]:
        sender = object()
        m = ClusterBeatMetrics(node="n", cluster="c", sender=sender, now=lambda: FIXED, **kwargs).connect()
        made.append(m)
        return m, sender

    yield make
    for m in made:
        m.close()


@pytest.mark.timeout(120)
def test_100000_stored_schedules_give_a_bounded_exposition_and_churn_does_not_grow_it(metrics):
    m, sender = metrics()
    m.set_config({"tick", "nightly"})
    send(sender, ["tick", "nightly"])
    first = [f"report:{i:06d}" for i in range(100_000)]
    send(sender, first)
    started = time.monotonic()
    body = m.exposition()
    took = time.monotonic() - started
    samples = parse(body.decode())
    assert len(body) < BOUND, len(body)
    assert took < 5.0, took  # 28 s before, on this machine
    assert value(samples, "cluster_beat_occurrences_total", outcome="sent") == 100_002  # nothing lost
    assert value(samples, "cluster_beat_send_lateness_seconds_count") == 100_002
    own = schedules_with_series(samples)
    assert own == {"tick", "nightly", *first[:DEFAULT_STORED_MAX]}  # the first to report, in order
    rest = 100_000 - DEFAULT_STORED_MAX
    assert value(samples, "cluster_beat_occurrences_total", outcome="sent", schedule=OVERFLOW) == rest
    assert value(samples, "cluster_beat_send_lateness_seconds_count", schedule=OVERFLOW) == rest
    assert value(samples, "cluster_beat_schedule_series", source="config") == 2
    assert value(samples, "cluster_beat_schedule_series", source="stored") == DEFAULT_STORED_MAX
    assert value(samples, "cluster_beat_schedule_series_refused_total") == rest  # each outcome once

    for name in first:  # all removed (beat says so for each): their slots are free again
        m.schedule_gone(name)
    second = [f"churn:{i:06d}" for i in range(100_000)]
    send(sender, second)
    again = m.exposition()
    samples = parse(again.decode())
    assert len(again) <= len(body) * 1.02, (len(again), len(body))  # the same size, not twice it
    assert schedules_with_series(samples) == {"tick", "nightly", *second[:DEFAULT_STORED_MAX]}
    # the removed schedules' own series went; the overflow series keeps its count
    assert value(samples, "cluster_beat_occurrences_total", outcome="sent") == 200_002 - DEFAULT_STORED_MAX


def test_every_slot_taken_by_the_longest_names_stays_within_a_few_megabytes(metrics):
    m, sender = metrics()
    config = [f"c{i:0254d}" for i in range(10)]
    m.set_config(set(config))
    names = config + [f"r{i:0254d}" for i in range(DEFAULT_STORED_MAX + 100)]
    for outcome in ("sent", "failed", "missed"):
        send(sender, names, outcome)
    for name in names:
        signals.watchdog_fired.send(sender=sender, schedule=name, task_id="t", age=1.0)
    body = m.exposition()
    assert len(body) < WORST_BOUND, len(body)
    assert len(schedules_with_series(parse(body.decode()))) == 10 + DEFAULT_STORED_MAX


def test_the_names_and_labels_of_before_the_bound_still_match_existing_alerts(metrics):
    m, sender = metrics()
    m.set_config({"billing"})
    send(sender, ["billing"], outcome="failed")
    send(sender, ["billing", "report:1"])
    signals.watchdog_fired.send(sender=sender, schedule="billing", task_id="t", age=1.0)
    s = parse(m.exposition().decode())
    # increase(cluster_beat_occurrences_total{outcome="failed",schedule="billing"}[1h]) and the like
    assert value(s, "cluster_beat_occurrences_total", outcome="failed", schedule="billing") == 1
    assert value(s, "cluster_beat_occurrences_total", outcome="sent", schedule="billing") == 1
    assert value(s, "cluster_beat_occurrences_total", outcome="sent", schedule="report:1") == 1
    assert value(s, "cluster_beat_send_lateness_seconds_bucket", schedule="billing", le="0.05") == 1
    assert value(s, "cluster_beat_send_lateness_seconds_sum", schedule="billing") == pytest.approx(0.05)
    assert value(s, "cluster_beat_watchdog_fired_total", schedule="billing") == 1
    # every labelled series has a schedule label: sum by (outcome) counts each occurrence once
    assert all("schedule" in lab for name in LABELLED for lab, _ in s.get(name, []))
    assert value(s, "cluster_beat_occurrences_total", outcome="sent") == 2
    assert not [n for n in s if n.startswith("cluster_beat_schedule_") and n.endswith("_total")
                and n != "cluster_beat_schedule_series_refused_total"]


def test_config_entries_always_have_series_of_their_own_and_stored_max_0_gives_stored_ones_none(metrics):
    m, sender = metrics(stored_max=0)
    m.set_config({"tick"})
    send(sender, ["tick", "report:1", "report:2"])
    signals.watchdog_fired.send(sender=sender, schedule="tick", task_id="t", age=1.0)
    signals.watchdog_fired.send(sender=sender, schedule="report:1", task_id="t", age=1.0)
    s = parse(m.exposition().decode())
    assert schedules_with_series(s) == {"tick"}
    assert value(s, "cluster_beat_occurrences_total", outcome="sent", schedule="tick") == 1
    assert value(s, "cluster_beat_occurrences_total", outcome="sent", schedule=OVERFLOW) == 2
    assert value(s, "cluster_beat_send_lateness_seconds_count", schedule="tick") == 1
    assert value(s, "cluster_beat_send_lateness_seconds_sum", schedule="tick") == pytest.approx(0.05)
    assert value(s, "cluster_beat_watchdog_fired_total", schedule="tick") == 1
    assert value(s, "cluster_beat_watchdog_fired_total", schedule=OVERFLOW) == 1
    assert value(s, "cluster_beat_occurrences_total", outcome="sent") == 3
    assert value(s, "cluster_beat_watchdog_fired_total") == 2
    assert value(s, "cluster_beat_schedule_series_refused_total") == 3  # each outcome once


def test_a_schedule_that_goes_loses_every_series_and_its_slot_goes_to_the_next_one(metrics):
    m, sender = metrics(stored_max=1)
    m.set_config({"tick"})
    send(sender, ["a"])
    send(sender, ["a"], outcome="skipped-overlap")
    signals.watchdog_fired.send(sender=sender, schedule="a", task_id="t", age=1.0)
    send(sender, ["b"])  # no slot left: under the overflow value
    s = parse(m.exposition().decode())
    assert schedules_with_series(s) == {"a"}
    m.schedule_gone("a")
    m.schedule_gone("tick")  # a config entry keeps its series whatever beat says
    s = parse(m.exposition().decode())
    assert schedules_with_series(s) == set()
    assert not [lab for name in LABELLED for lab, _ in s.get(name, []) if lab.get("schedule") == "a"]
    assert value(s, "cluster_beat_schedule_series", source="stored") == 0
    send(sender, ["b", "tick"])
    s = parse(m.exposition().decode())
    assert schedules_with_series(s) == {"b", "tick"}
    assert value(s, "cluster_beat_occurrences_total", schedule="b") == 1  # counted from its slot on
    assert value(s, "cluster_beat_occurrences_total", schedule=OVERFLOW) == 1  # its first, before
    assert value(s, "cluster_beat_occurrences_total") == 3  # a's two went with its series


def test_a_node_that_stops_scheduling_drops_the_stored_schedules_series_and_keeps_the_configs(metrics):
    m, sender = metrics()
    m.set_config({"tick"})
    signals.lease_changed.send(sender=sender, event="acquired", node="n", term=3, info={})
    send(sender, ["tick", "report:1"])
    signals.lease_changed.send(sender=sender, event="lost", node="n", term=3, info={})
    s = parse(m.exposition().decode())
    assert schedules_with_series(s) == {"tick"}
    assert value(s, "cluster_beat_occurrences_total", outcome="sent") == 1


def test_per_schedule_off_leaves_the_schedule_label_out_as_before(metrics):
    m, sender = metrics(per_schedule=False)
    m.set_config({"tick"})
    send(sender, ["tick", "report:1"])
    signals.watchdog_fired.send(sender=sender, schedule="tick", task_id="t", age=1.0)
    s = parse(m.exposition().decode())
    assert all("schedule" not in lab for name in LABELLED for lab, _ in s.get(name, []))
    assert value(s, "cluster_beat_occurrences_total", outcome="sent") == 2
    assert value(s, "cluster_beat_watchdog_fired_total") == 1
    assert value(s, "cluster_beat_schedule_series_refused_total") == 0


@pytest.mark.parametrize("bad", [-1, 10_001, "500", True, 2.5])
def test_a_bad_stored_max_is_refused_naming_the_setting(bad):
    from celery_cluster_beat.config import load_settings
    from celery_cluster_beat.errors import ConfigError

    app = Celery("metrics-settings", broker="memory://")
    app.conf.update(cluster_beat_metrics_stored_max=bad)
    with pytest.raises(ConfigError) as err:
        load_settings(app.conf, has_result_backend=lambda: False)
    assert "setting cluster_beat_metrics_stored_max:" in str(err.value)


@pytest.mark.parametrize("given, kept", [(None, DEFAULT_STORED_MAX), (0, 0), (10_000, 10_000)])
def test_stored_max_defaults_to_500_and_0_means_none(given, kept):
    from celery_cluster_beat.config import load_settings

    app = Celery("metrics-settings", broker="memory://")
    if given is not None:
        app.conf.update(cluster_beat_metrics_stored_max=given)
    assert load_settings(app.conf, has_result_backend=lambda: False).metrics_stored_max == kept


# ----------------------------------------------------------------------------- a real Scheduler


def _run(sched, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        time.sleep(max(0.0, min(sched.tick(), end - time.monotonic())))


def _scrape(url: str) -> Samples:
    with urllib.request.urlopen(url + "metrics", timeout=10) as resp:
        return parse(resp.read().decode())


@pytest.mark.timeout(90)
def test_beat_removes_the_series_of_a_stored_schedule_removed_at_run_time(tmp_path, redis_url):
    from celery_cluster_beat.beat.scheduler import Scheduler
    from celery_cluster_beat.dynamic import StoredSchedules

    broker = urlunsplit(urlsplit(redis_url)._replace(path="/7"))
    name = "ccb_metrics_" + uuid.uuid4().hex[:8]
    app = Celery(name, broker=broker, set_as_current=False)
    app.conf.update(task_default_queue="q_" + name, cluster_beat_db_url=f"sqlite:///{tmp_path}/claims.sqlite3",
                    cluster_beat_redis_url="", cluster_beat_http_port=0,
                    beat_schedule={"tick": {"task": "t.x", "schedule": every(1)}})
    api = StoredSchedules(app)
    api.add("report:1", "t.y", every(1))
    sched = Scheduler(app, lazy=False)
    try:
        url = sched._ops.url
        deadline = time.monotonic() + 30
        while schedules_with_series(_scrape(url)) != {"tick", "report:1"}:
            assert time.monotonic() < deadline, _scrape(url)
            _run(sched, 0.5)
        assert value(_scrape(url), "cluster_beat_stored_schedules") == 1  # counted in the claim store
        api.remove("report:1")
        _run(sched, 1.5)  # the removal is read within a second
        time.sleep(1.1)  # /metrics is rebuilt at most once a second
        s = _scrape(url)
        assert schedules_with_series(s) == {"tick"}
        assert value(s, "cluster_beat_schedule_series", source="stored") == 0
        assert value(s, "cluster_beat_occurrences_total", outcome="sent", schedule="tick") >= 1
    finally:
        sched.close()
        api.close()
        client = redis.Redis.from_url(broker)
        client.delete("q_" + name)
        client.close()
