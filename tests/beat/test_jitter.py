"""Deterministic jitter (``jitter`` per entry, ``cluster_beat_jitter`` globally).

The delay of an occurrence is derived from a hash of (schedule name, nominal
instant): every replica, every process, every resend computes the same one. It
is below ``jitter`` and below 90 % of the gap to the next occurrence (so two
fires never swap order), zero when jitter is 0. It is applied after the claim,
as the message's ``eta``; the ``cluster_beat_scheduled_at`` header keeps the
nominal instant.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

import procs
from celery_cluster_beat import cron
from celery_cluster_beat.beat.jitter import GAP_SHARE, jitter_delay
from celery_cluster_beat.store import ClaimStore

UTC = timezone.utc
REPO = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 3, 29, 0, 30, tzinfo=UTC)

SAMPLES = [(f"report-{i % 7}", T0 + timedelta(minutes=i), 30.0, T0 + timedelta(minutes=i + 1)) for i in range(200)]

COMPUTE = """
import json, sys
from datetime import datetime
from celery_cluster_beat.beat.jitter import jitter_delay
samples = json.loads(sys.stdin.read())
print(json.dumps([jitter_delay(n, datetime.fromisoformat(a), j, datetime.fromisoformat(b)) for n, a, j, b in samples]))
"""


def test_the_delay_is_identical_in_every_process():
    """Three interpreters with different hash seeds (and one in another time zone) compute the
    very same delays as this one: nothing depends on the process."""
    payload = json.dumps([(n, a.isoformat(), j, b.isoformat()) for n, a, j, b in SAMPLES])
    here = [jitter_delay(*s) for s in SAMPLES]
    for seed, tz in (("1", "UTC"), ("2", "America/New_York"), ("12345", "Asia/Kolkata")):
        env = dict(os.environ, PYTHONHASHSEED=seed, TZ=tz, PYTHONPATH=str(REPO))
        out = subprocess.run([sys.executable, "-c", COMPUTE], input=payload, capture_output=True, text=True,
                             env=env, timeout=60, check=True)
        assert json.loads(out.stdout) == here
    assert len(set(here)) > 150, "delays differ from one occurrence to the next"


def test_the_same_instant_in_any_zone_gets_the_same_delay():
    at = T0 + timedelta(hours=3)
    paris = at.astimezone(timezone(timedelta(hours=2)))
    assert jitter_delay("x", at, 10, at + timedelta(hours=1)) == jitter_delay("x", paris, 10, at + timedelta(hours=1))


@pytest.mark.parametrize("jitter", [0.5, 7.0, 30.0, 3600.0])
def test_the_delay_stays_below_the_jitter_and_below_the_gap(jitter):
    """Every-minute samples: below min(jitter, 0.9 x 60 s); spread over that range."""
    delays = []
    for i in range(2000):
        at = T0 + timedelta(minutes=i)
        d = jitter_delay("spread", at, jitter, at + timedelta(minutes=1))
        delays.append(d)
        assert 0 <= d < min(jitter, GAP_SHARE * 60)
    cap = min(jitter, GAP_SHARE * 60)
    assert 0.4 * cap < sum(delays) / len(delays) < 0.6 * cap  # about uniform: mean near cap / 2
    assert max(delays) > 0.95 * cap and min(delays) < 0.05 * cap


def test_an_irregular_cron_is_capped_by_each_gap_of_its_own():
    """``0,1 * * * *``: a 1-minute gap then a 59-minute one; a jitter of 10 minutes may use up to
    54 s after :00 (90 % of the gap to :01), and the full 10 minutes after :01."""
    sched = cron("0,1 * * * *")
    at = datetime(2026, 1, 1, 0, 0, tzinfo=UTC)
    short, long_ = [], []
    for _ in range(400):
        nxt = sched.next_fire(at)
        d = jitter_delay("irregular", at, 600, nxt)
        (short if at.minute == 0 else long_).append(d)
        assert at + timedelta(seconds=d) < nxt, "a jittered fire never passes the next occurrence"
        at = nxt
    assert max(short) < 54 and max(short) > 40
    assert max(long_) < 600 and max(long_) > 400


def test_no_jitter_means_no_delay():
    at = T0
    for jitter in (0, 0.0, None, -5):
        assert jitter_delay("x", at, jitter, at + timedelta(minutes=1)) == 0.0
    assert jitter_delay("x", at, 30, at) == 0.0  # no gap at all: nothing to spread over


def test_the_delay_never_reaches_the_cap_even_at_the_top_of_the_hash_range(monkeypatch):
    """The largest possible hash still gives a delay strictly below the cap."""
    import celery_cluster_beat.beat.jitter as jitter_module

    class Top:
        def digest(self):
            return b"\xff" * 32

    monkeypatch.setattr(jitter_module.hashlib, "sha256", lambda data: Top())
    for cap in (1e-6, 0.3, 1.0, 7.77, 54.0, 3600.0):
        at = T0
        d = jitter_module.jitter_delay("x", at, cap, at + timedelta(days=1))
        assert 0 <= d < cap, (cap, d)


# ------------------------------------------------------------------------------ in a real beat


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_real_beat_sends_jittered_occurrences_with_an_eta_and_the_nominal_header(redis_url, tmp_path):
    """Three entries every 2 s: per-entry jitter 1.5 s, the global 0.8 s, and jitter 0. The
    message goes out at the nominal instant (claimed and sent then), with ``eta`` = nominal +
    jitter_delay; its ``cluster_beat_scheduled_at`` header is the nominal instant."""
    tag = uuid.uuid4().hex[:6]
    own, glob, plain = f"own-{tag}", f"global-{tag}", f"plain-{tag}"
    app = procs.write_app(
        tmp_path, broker=redis_url, db_url=f"sqlite:///{tmp_path}/claims.sqlite3",
        schedule=f"""{{
            {own!r}: {{"task": "t.record", "schedule": every(2), "jitter": 1.5}},
            {glob!r}: {{"task": "t.record", "schedule": every(2)}},
            {plain!r}: {{"task": "t.record", "schedule": every(2), "jitter": 0}},
        }}""",
        conf='{"cluster_beat_jitter": 0.8}',
    )
    beat = procs.start_beat(app, tmp_path, "beat")
    try:
        procs.wait_for(lambda: sum(1 for m in app.sent_occurrences() if m[0] == own) >= 3, 40,
                       what="three jittered messages")
    except AssertionError as exc:
        raise AssertionError(f"{exc}\n{beat.log()[-3000:]}") from None
    finally:
        beat.stop()
    messages = app.queued_messages()
    try:
        store = ClaimStore(f"sqlite:///{tmp_path}/claims.sqlite3", node_id="reader")
        store.open()
        sent_at = {(r.schedule, r.scheduled_at): r.sent_at for s in (own, glob, plain) for r in store.claims(s)}
        store.close()
        seen = {own: 0, glob: 0, plain: 0}
        ahead = 0  # messages published before their eta
        for msg in messages:
            h = msg["headers"]
            sched = h["cluster_beat_schedule"]
            nominal = datetime.fromisoformat(h["cluster_beat_scheduled_at"].replace("Z", "+00:00"))
            seen[sched] += 1
            assert nominal.timestamp() % 2 == 0 and nominal.microsecond == 0, nominal  # the every(2) grid
            jitter = {own: 1.5, glob: 0.8, plain: 0}[sched]
            delay = jitter_delay(sched, nominal, jitter, nominal + timedelta(seconds=2))
            if sched == plain:
                assert h["eta"] is None, h
                continue
            assert 0 < delay < jitter
            eta = datetime.fromisoformat(h["eta"])
            assert abs((eta - nominal).total_seconds() - delay) < 1e-5, (eta, nominal, delay)
            # Applied after the claim: the message left at the nominal instant, the worker waits.
            assert (sent_at[(sched, nominal)] - nominal).total_seconds() < 1.0
            ahead += sent_at[(sched, nominal)] < eta
        assert seen[own] >= 3 and seen[glob] >= 2 and seen[plain] >= 2, seen
        assert ahead >= 2, "the delay is the worker's to wait (eta), not the scheduler's"
    finally:
        import redis

        r = redis.Redis.from_url(redis_url)
        r.delete(app.queue)
        r.close()
