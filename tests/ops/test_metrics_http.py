"""Beat's HTTP server, end to end: ``/metrics``, ``/healthz`` and the status page of real
``celery beat`` replicas with claims in PostgreSQL and the leader lease in Redis.

* ``/metrics`` is parsed with prometheus-client's own parser of the text format; the
  counters must move (sends of an ``every(1)`` schedule, lateness observations, claim-store
  transactions, lease renewals) and exactly one replica says it is the leader.
* ``/healthz`` is 200 on a ticking beat and 503 while its loop is stalled: the fault point
  ``before-publish`` (``CCB_FAULTS``) makes the leader sleep inside its send path, so the loop
  stops ticking while the HTTP thread keeps answering; when the sleep ends it is 200 again.
* The status page is loaded by a real headless browser (Debian's ``chromium``); its DOM must
  name the leader and every schedule, and never the database password (PostgreSQL's trust
  authentication ignores the one we put in the URL). The screenshot's path is printed.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import pytest
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy.engine import make_url

from cluster import node_pid
from procs import Proc, _free_port, start_beat, wait_for, write_app

PASSWORD = "Secr3t-xyz"
SCHEDULE = """{
    'tick': {'task': 't.record', 'schedule': every(1)},
    'nightly': {'task': 't.record', 'schedule': cron('30 2 * * *'), 'description': 'night <b>job</b>'},
}"""
#: The app reads its port from the environment: each replica gets its own.
CONF = """{
    'cluster_beat_lock_ttl': 2,
    'cluster_beat_claim_grace': 6,
    'cluster_beat_http_port': int(os.environ['CCB_TEST_HTTP_PORT']),
    'cluster_beat_metrics_per_schedule': os.environ.get('CCB_TEST_PER_SCHEDULE', '1') == '1',
}"""
FAULT_LINE = "cluster-beat fault point"
URL_LOG = re.compile(r"status page, /metrics and /healthz on (http://\S+/)")


# ----------------------------------------------------------------------------- helpers


def with_password(url: str) -> str:
    return make_url(url).set(password=PASSWORD).render_as_string(hide_password=False)


def get(url: str, timeout: float = 5.0) -> Tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def answers(url: str) -> bool:
    try:
        get(url, timeout=1.0)
        return True
    except OSError:
        return False


Samples = Dict[str, List[Tuple[Dict[str, str], float]]]


def scrape(base: str) -> Samples:
    """Every sample of ``/metrics`` by sample name, as parsed by prometheus-client."""
    status, text = get(base + "metrics")
    assert status == 200, text
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out


def value(samples: Samples, name: str, **labels: str) -> float:
    """Sum of the samples of *name* whose labels include *labels* (0 when there is none)."""
    return sum(v for lab, v in samples.get(name, []) if all(lab.get(k) == x for k, x in labels.items()))


class Replica:
    def __init__(self, proc: Proc, port: int) -> None:
        self.proc, self.port = proc, port
        self.base = f"http://127.0.0.1:{port}/"

    def healthz(self) -> int:
        return get(self.base + "healthz", timeout=3.0)[0]


def start_replicas(app, tmp: Path, n: int, env: Optional[Dict[str, str]] = None) -> List[Replica]:
    out = []
    for i in range(n):
        port = _free_port()
        proc = start_beat(app, tmp, f"b{i}", env={"CCB_TEST_HTTP_PORT": str(port), **(env or {})})
        out.append(Replica(proc, port))
    return out


def logs(replicas: List[Replica]) -> str:
    return "\n".join(f"----- {r.proc.log_path.name} (pid {r.proc.pid})\n{r.proc.log()[-3000:]}" for r in replicas)


def leader_of(replicas: List[Replica], timeout: float) -> Replica:
    """The one replica whose ``cluster_beat_leader`` is 1 while every other says 0."""
    found: List[Replica] = []

    def check() -> bool:
        flags = [value(scrape(r.base), "cluster_beat_leader") for r in replicas]
        found[:] = [r for r, f in zip(replicas, flags) if f == 1]
        return len(found) == 1 and sorted(flags) == [0.0] * (len(replicas) - 1) + [1.0]

    wait_for(check, timeout, interval=0.25, what="exactly one replica reporting cluster_beat_leader 1")
    return found[0]


def chromium() -> str:
    exe = shutil.which("chromium")
    if exe is None:
        pytest.fail("the status page test needs a real headless browser: install Debian's chromium package "
                    "(apt-get install -y chromium; .ci/run does this)", pytrace=False)
    return exe


def browse(url: str, tmp: Path, label: str) -> Tuple[str, Path]:
    """Load *url* in headless chromium: (the DOM after load, a screenshot's path)."""
    exe = chromium()
    common = [exe, "--headless", "--disable-gpu", "--no-sandbox", "--disable-dev-shm-usage",
              "--no-first-run", "--hide-scrollbars", f"--user-data-dir={tmp / ('chromium-' + label)}"]
    dom = subprocess.run([*common, "--dump-dom", url], capture_output=True, text=True, timeout=90)
    assert dom.returncode == 0 and "<html" in dom.stdout, f"chromium --dump-dom failed:\n{dom.stderr[-2000:]}"
    shot = tmp / f"status-page-{label}.png"
    pic = subprocess.run([*common, "--window-size=1280,1600", f"--screenshot={shot}", url],
                         capture_output=True, text=True, timeout=90)
    assert pic.returncode == 0 and shot.exists() and shot.stat().st_size > 0, \
        f"chromium --screenshot failed:\n{pic.stderr[-2000:]}"
    return dom.stdout, shot


# ----------------------------------------------------------------------------- the tests


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_metrics_healthz_and_status_page_of_two_real_replicas(tmp_path, redis_url, pg_url, capsys):
    db_url = with_password(pg_url)
    arm_dir = tmp_path / "arm"
    arm_dir.mkdir()
    pause = 14.0
    app = write_app(tmp_path, broker=redis_url, db_url=db_url, redis_url=None, schedule=SCHEDULE, conf=CONF)
    replicas = start_replicas(app, tmp_path, 2, env={"CCB_FAULTS": f"before-publish=sleep:{pause:g}",
                                                     "CCB_FAULT_ARM_DIR": str(arm_dir)})
    try:
        wait_for(lambda: all(answers(r.base + "healthz") for r in replicas), 60,
                 what="both replicas' HTTP servers answering")
        for r in replicas:
            assert f"status page, /metrics and /healthz on {r.base}" in r.proc.log()
        assert [r.healthz() for r in replicas] == [200, 200], logs(replicas)

        # -- /metrics: one leader, and its counters move with the every(1) schedule
        leader = leader_of(replicas, 60)
        standby = next(r for r in replicas if r is not leader)
        node = next(lab["node"] for lab, _ in scrape(leader.base)["cluster_beat_node_info"])
        assert node_pid(node) == leader.proc.pid
        standby_node = next(lab["node"] for lab, _ in scrape(standby.base)["cluster_beat_node_info"])
        wait_for(lambda: value(scrape(leader.base), "cluster_beat_occurrences_total",
                               outcome="sent", schedule="tick") >= 2, 30, what="the leader counting sends")
        first = scrape(leader.base)
        time.sleep(3.5)
        second = scrape(leader.base)
        sent = [value(s, "cluster_beat_occurrences_total", outcome="sent", schedule="tick") for s in (first, second)]
        late = [value(s, "cluster_beat_send_lateness_seconds_count", schedule="tick") for s in (first, second)]
        assert sent[1] >= sent[0] + 2, sent
        assert late[1] >= late[0] + 2, late
        assert late[1] <= sent[1] + value(second, "cluster_beat_occurrences_total", outcome="resent")
        # every(1) sent by a loop that sleeps until the instant: well under a second late, mostly
        assert value(second, "cluster_beat_send_lateness_seconds_bucket", schedule="tick", le="1.0") >= late[1] - 2
        assert value(second, "cluster_beat_lease_term") >= 1
        assert value(second, "cluster_beat_lease_events_total", event="acquired") >= 1
        assert value(second, "cluster_beat_lease_renew_seconds_count") > value(first, "cluster_beat_lease_renew_seconds_count")
        assert value(second, "cluster_beat_claim_store_seconds_count") > value(first, "cluster_beat_claim_store_seconds_count")
        assert value(second, "cluster_beat_claim_store_errors_total") == 0
        other = scrape(standby.base)
        assert value(other, "cluster_beat_leader") == 0
        assert value(other, "cluster_beat_occurrences_total", outcome="sent") == 0
        assert value(other, "cluster_beat_claim_store_seconds_count") > 0  # heartbeats
        assert value(other, "cluster_beat_tick_age_seconds") < 10

        # -- the status page, in a real browser, served by the standby: it names the leader
        status, raw = get(standby.base)
        assert status == 200, raw
        # read-only (no actions token): the filter bar is a GET form, nothing posts; no script at all
        assert PASSWORD not in raw and 'method="post"' not in raw.lower() and "<script" not in raw.lower()
        assert 'id="health"' in raw and 'id="nodes"' in raw
        dom, shot = browse(standby.base, tmp_path, "standby")
        with capsys.disabled():
            print(f"\nstatus page screenshot: {shot}")
        assert node in dom, f"the leader {node} is not on the page:\n{dom[:4000]}"
        assert standby_node in dom
        for name in ("tick", "nightly"):
            assert re.search(rf">\s*{name}\s*<", dom), f"schedule {name!r} is not on the page:\n{dom[:4000]}"
        assert PASSWORD not in dom
        assert "<b>job</b>" not in dom  # escaped, not markup
        assert 'method="post"' not in dom.lower() and "<script" not in dom.lower()
        health_line = re.search(r'<ul class="health" id="health">(.*?)</ul>', dom, re.S)
        assert health_line and node in health_line.group(1) and "Failed 1 h" in health_line.group(1), dom[:4000]
        status, detail = get(standby.base + "schedules/tick")  # one schedule's page: its sends so far
        if status == 503:  # the standby just built the main page: one view at a time, told when to retry
            time.sleep(2.5)
            status, detail = get(standby.base + "schedules/tick")
        assert status == 200 and "Recent occurrences" in detail and ">sent<" in detail, detail[:3000]
        assert get(standby.base, timeout=5)[0] == 200
        req = urllib.request.Request(standby.base, data=b"x=1", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(req, timeout=5)
        assert refused.value.code == 405

        # -- /healthz: 503 while the leader's loop sleeps inside its send path, 200 after
        (arm_dir / f"before-publish-{leader.proc.pid}").touch()
        wait_for(lambda: FAULT_LINE in leader.proc.log(), 15, what="the leader reaching the armed fault point")
        stalled_at = time.monotonic()
        codes: List[int] = []

        def stalled() -> bool:
            codes.append(leader.healthz())
            return codes[-1] == 503

        wait_for(stalled, pause - 1, interval=0.25, what="/healthz of the stalled leader saying 503")
        assert time.monotonic() - stalled_at >= 3.0, "503 long before the margin (5 s) passed"
        assert standby.healthz() == 200  # the other replica's loop runs on
        assert value(scrape(leader.base), "cluster_beat_tick_age_seconds") > 5  # /metrics answers too
        wait_for(lambda: leader.healthz() == 200, pause + 30, interval=0.25,
                 what="/healthz of the leader saying 200 once the pause ended")
        # the lease (ttl 2 s) went to the other replica meanwhile; the woken one says it lost it
        new_leader = leader_of(replicas, 30)
        assert new_leader is standby, logs(replicas)
        assert value(scrape(leader.base), "cluster_beat_lease_events_total", event="lost") >= 1
    except BaseException:
        print(logs(replicas))
        raise
    finally:
        for r in replicas:
            r.proc.stop()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_port_zero_picks_a_free_port_and_per_schedule_labels_can_be_turned_off(tmp_path, redis_url, pg_url):
    app = write_app(tmp_path, broker=redis_url, db_url=pg_url, redis_url=None, schedule=SCHEDULE, conf=CONF)
    proc = start_beat(app, tmp_path, "b0", env={"CCB_TEST_HTTP_PORT": "0", "CCB_TEST_PER_SCHEDULE": "0"})
    try:
        wait_for(lambda: URL_LOG.search(proc.log()) is not None, 60, what="beat logging its HTTP address")
        base = URL_LOG.search(proc.log()).group(1)
        assert base.startswith("http://127.0.0.1:") and not base.endswith(":0/")
        wait_for(lambda: value(scrape(base), "cluster_beat_occurrences_total", outcome="sent") >= 2, 60,
                 what="sends counted")
        samples = scrape(base)
        for name in ("cluster_beat_occurrences_total", "cluster_beat_send_lateness_seconds_count"):
            assert samples[name] and all("schedule" not in lab for lab, _ in samples[name]), samples[name]
        assert get(base + "healthz")[0] == 200
        assert get(base + "nope")[0] == 404
    except BaseException:
        print(proc.log()[-4000:])
        raise
    finally:
        proc.stop()


@pytest.mark.parametrize("setting, bad", [
    ("cluster_beat_http_port", 70000), ("cluster_beat_http_port", "8080"), ("cluster_beat_http_port", True),
    ("cluster_beat_http_host", ""), ("cluster_beat_metrics_per_schedule", "no"),
    ("cluster_beat_http_page", "no"), ("cluster_beat_http_token", "short-token"),
    ("cluster_beat_http_token", 1234567890123456789), ("cluster_beat_http_token", "a token with spaces in it"),
])
def test_bad_http_settings_are_refused_naming_the_setting(setting, bad):
    from celery import Celery

    from celery_cluster_beat.config import load_settings
    from celery_cluster_beat.errors import ConfigError

    app = Celery("http-settings", broker="memory://")
    app.conf.update({setting: bad})
    with pytest.raises(ConfigError) as err:
        load_settings(app.conf, has_result_backend=lambda: False)
    assert f"setting {setting}:" in str(err.value)
    if setting == "cluster_beat_http_token":
        assert str(bad) not in str(err.value)  # a secret, even a bad one, is never printed


def test_http_settings_default_to_off():
    from celery import Celery

    from celery_cluster_beat.config import load_settings

    s = load_settings(Celery("http-settings", broker="memory://").conf, has_result_backend=lambda: False)
    assert (s.http_port, s.http_host, s.metrics_per_schedule) == (None, "127.0.0.1", True)
    assert (s.http_page, s.http_token) == (True, None)


def test_the_token_is_never_printed_with_the_settings():
    from celery import Celery

    from celery_cluster_beat.config import load_settings

    app = Celery("http-settings", broker="memory://")
    app.conf.update(cluster_beat_http_token="s3cret-token-0123456789", cluster_beat_http_page=False)
    s = load_settings(app.conf, has_result_backend=lambda: False)
    assert (s.http_token, s.http_page) == ("s3cret-token-0123456789", False)
    assert "s3cret" not in repr(s) and "http_token='***'" in repr(s)


def test_each_metrics_instance_counts_only_its_own_scheduler_in_a_registry_of_its_own():
    from datetime import datetime, timedelta, timezone

    from celery_cluster_beat import signals
    from celery_cluster_beat.ops.metrics import ClusterBeatMetrics

    a, b = object(), object()
    fixed = datetime(2026, 1, 1, tzinfo=timezone.utc)
    ma = ClusterBeatMetrics(node="a", sender=a, now=lambda: fixed).connect()
    mb = ClusterBeatMetrics(node="b", sender=b, per_schedule=False, now=lambda: fixed).connect()
    worker = ClusterBeatMetrics(node="w").connect()  # sender=None: a worker process
    try:
        for sender in (a, a, b):
            signals.occurrence_handled.send(sender=sender, outcome="sent", schedule="s1",
                                            scheduled_at=fixed - timedelta(seconds=0.3), task_id="t", reason=None)
        signals.lease_changed.send(sender=b, event="acquired", node="b", term=4, info={})
        signals.run_handled.send(sender=object(), outcome="duplicate-skipped", schedule="s1", scheduled_at=fixed,
                                 task_id="t", worker="w1", runtime=None, error=None)
        ma.store_observer(0.01, True)
        ma.store_observer(0.02, False)
        pa, pb, pw = (parse(m.exposition().decode()) for m in (ma, mb, worker))
        assert value(pa, "cluster_beat_occurrences_total", outcome="sent", schedule="s1") == 2
        assert value(pa, "cluster_beat_send_lateness_seconds_sum") == pytest.approx(0.6)
        assert value(pa, "cluster_beat_send_lateness_seconds_bucket", le="0.25") == 0
        assert value(pa, "cluster_beat_send_lateness_seconds_bucket", le="0.5") == 2
        assert value(pa, "cluster_beat_leader") == 0 and value(pb, "cluster_beat_leader") == 1
        assert value(pb, "cluster_beat_lease_term") == 4
        assert [lab for lab, _ in pb["cluster_beat_occurrences_total"]] == [{"outcome": "sent"}]  # no schedule label
        assert value(pa, "cluster_beat_claim_store_seconds_count") == 2
        assert value(pa, "cluster_beat_claim_store_errors_total") == 1
        assert value(pa, "cluster_beat_runs_total") == 0  # beat: run_handled is the workers'
        assert value(pw, "cluster_beat_occurrences_total", outcome="duplicate-skipped", schedule="s1") == 1
        assert value(pw, "cluster_beat_runs_total", outcome="duplicate-skipped") == 1
        assert value(pw, "cluster_beat_occurrences_total", outcome="sent") == 3  # counts every sender
    finally:
        for m in (ma, mb, worker):
            m.close()


def parse(text: str) -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out.setdefault(s.name, []).append((dict(s.labels), s.value))
    return out
