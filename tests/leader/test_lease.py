"""The Redis leader lease, against real Redis servers only.

Most tests use the shared Redis of ``redis_url`` under a lease name of their own.
Tests that need to break Redis (kill, restart, freeze, make it slow) or a special
server (Sentinel, TLS, a unix socket) start throwaway ``redis-server`` processes
on free ports and kill them afterwards.
"""
from __future__ import annotations

import logging
import shutil
import signal
import socket
import ssl
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import List, Optional

import pytest
import redis
from redis.crc import key_slot
from redis.sentinel import SentinelConnectionPool, SentinelManagedConnection, SentinelManagedSSLConnection

from celery_cluster_beat.errors import ConfigError
from celery_cluster_beat.leader.lease import LeaseEvent, RedisLease, lease_keys
from celery_cluster_beat.leader.redisconn import redis_client_from_url

# --------------------------------------------------------------------------- helpers


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class RedisServer:
    """A throwaway ``redis-server`` (no persistence) we may kill, freeze and restart."""

    def __init__(self, workdir: Path, *args: str, port: Optional[int] = None, sentinel: bool = False,
                 conf: Optional[Path] = None, tls: bool = False) -> None:
        if shutil.which("redis-server") is None:
            pytest.fail("redis-server is not on PATH; these tests start throwaway Redis servers", pytrace=False)
        self.port = port or free_port()
        self.workdir = workdir
        self.args = args
        self.sentinel = sentinel
        self.conf = conf
        self.tls = tls
        self.proc: Optional[subprocess.Popen] = None
        self.log = workdir / f"redis-{self.port}.log"

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def command(self) -> List[str]:
        cmd = ["redis-server"]
        if self.conf is not None:
            cmd.append(str(self.conf))
        if self.sentinel:
            cmd.append("--sentinel")
        else:
            cmd += ["--port", "0" if self.tls else str(self.port), "--bind", "127.0.0.1",
                    "--save", "", "--appendonly", "no", "--dir", str(self.workdir)]
        return cmd + ["--logfile", str(self.log), *self.args]

    def start(self, client_kwargs: Optional[dict] = None) -> "RedisServer":
        self.proc = subprocess.Popen(self.command(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        kwargs = {"host": "127.0.0.1", "port": self.port, "socket_timeout": 0.5, "socket_connect_timeout": 0.5}
        kwargs.update(client_kwargs or {})
        deadline = time.monotonic() + 10
        while True:
            if self.proc.poll() is not None:
                log = self.log.read_text() if self.log.exists() else ""
                pytest.fail(f"`{' '.join(self.command())}` exited with {self.proc.returncode}:\n{log[-2000:]}",
                            pytrace=False)
            try:
                with redis.Redis(**kwargs) as client:
                    if client.ping():
                        return self
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                self.kill()
                pytest.fail(f"`{' '.join(self.command())}` did not answer PING within 10 s", pytrace=False)
            time.sleep(0.02)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.send_signal(signal.SIGCONT)
            except ProcessLookupError:  # pragma: no cover
                pass
            self.proc.kill()
            self.proc.wait(5)
        self.proc = None

    def freeze(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def thaw(self) -> None:
        self.proc.send_signal(signal.SIGCONT)


@pytest.fixture
def servers(tmp_path):
    """``servers(*args, **kw)`` starts a throwaway redis-server; all are killed at the end."""
    started: List[RedisServer] = []

    def start(*args: str, **kwargs) -> RedisServer:
        client_kwargs = kwargs.pop("client_kwargs", None)
        server = RedisServer(tmp_path, *args, **kwargs)
        started.append(server)
        return server.start(client_kwargs)

    yield start
    for server in started:
        server.kill()


class Events:
    """An ``on_event`` callback that records what the lease reports."""

    def __init__(self) -> None:
        self.items: List[tuple] = []

    def __call__(self, event: LeaseEvent, info: dict) -> None:
        self.items.append((event, info))

    def count(self, event: LeaseEvent) -> int:
        return sum(1 for e, _ in self.items if e is event)

    def kinds(self) -> List[LeaseEvent]:
        return [e for e, _ in self.items]

    def last(self, event: LeaseEvent) -> dict:
        return [info for e, info in self.items if e is event][-1]


@pytest.fixture
def make_lease(redis_url, redis_prefix, servers):
    """``make_lease(node_id, url=..., **kwargs) -> (lease, events)``; closes the leases, deletes the keys.

    (It depends on ``servers`` so that leases are closed before throwaway servers are killed.)
    """
    leases: List[RedisLease] = []
    name = redis_prefix + "app"

    def make(node_id: str, *, url: str = redis_url, socket_timeout: float = 2.0, name: str = name,
             transport_options: Optional[dict] = None, **kwargs):
        events = Events()
        lease = RedisLease(
            lambda: redis_client_from_url(url, socket_timeout=socket_timeout, transport_options=transport_options),
            name=name, node_id=node_id, on_event=events, **kwargs,
        )
        leases.append(lease)
        return lease, events

    yield make
    for lease in leases:
        lease.close()
    with redis.Redis.from_url(redis_url) as client:
        client.delete(*lease_keys(name)[:2])


def admin(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, socket_timeout=5)


# ------------------------------------------------------------ one leader, rising terms


def test_only_one_of_two_acquires_and_terms_strictly_increase(make_lease, redis_url):
    a, a_events = make_lease("node-a")
    b, b_events = make_lease("node-b")

    assert a.try_acquire() is True
    assert (a.is_leader, a.term) == (True, a.term) and isinstance(a.term, int)
    assert b.try_acquire() is False
    assert (b.is_leader, b.term) == (False, None)
    assert b.holder == "node-a"

    terms = [a.term]
    leader, standby = a, b
    for _ in range(4):
        leader.release()
        assert (leader.is_leader, leader.term) == (False, None)
        # the standby gets it at once (no waiting for an expiry), with a higher term
        assert standby.try_acquire() is True
        assert standby.term > terms[-1]
        terms.append(standby.term)
        assert leader.try_acquire() is False
        leader, standby = standby, leader
    assert terms == sorted(set(terms))
    assert a_events.kinds()[:2] == [LeaseEvent.ACQUIRED, LeaseEvent.RELEASED]
    assert a_events.last(LeaseEvent.ACQUIRED)["term"] in terms

    # the key names its holder and term, for operators
    with admin(redis_url) as client:
        value = client.get(leader.lease_key).decode()
    assert value.endswith(f":{leader.term}:{leader.node_id}")


def test_constructing_does_not_connect_and_bad_settings_are_config_errors():
    calls = []

    def factory():
        calls.append(1)
        return redis_client_from_url("redis://127.0.0.1:1/0")

    RedisLease(factory, name="x", node_id="n")
    assert calls == []

    for kwargs in ({"ttl": 0.01}, {"ttl": 1.0, "safety_margin": 0.6}, {"ttl": 1.0, "safety_margin": -0.1},
                   {"name": ""}, {"node_id": ""}):
        params = {"name": "x", "node_id": "n", **kwargs}
        with pytest.raises(ConfigError):
            RedisLease(factory, **params)


# ------------------------------------------------------------------------ expiry


def test_a_holder_that_stops_renewing_loses_to_the_standby_after_ttl(make_lease):
    ttl = 1.0
    a, a_events = make_lease("node-a", ttl=ttl)
    b, _ = make_lease("node-b", ttl=ttl)

    sent = time.monotonic()
    assert a.try_acquire()
    a_valid_until = a.valid_until
    assert sent + ttl - a.safety_margin <= a_valid_until <= time.monotonic() + ttl - a.safety_margin

    # node-a stops calling maintain(); node-b keeps trying
    while not b.try_acquire():
        assert time.monotonic() - sent < 3 * ttl, "the standby never got the expired lease"
        time.sleep(0.01)
    acquired = time.monotonic()
    # not before the key can have expired (a lower bound of physics); after it, as soon as the
    # standby's next try (every 10 ms) gets through: well before a second ttl would have passed
    assert ttl <= acquired - sent <= ttl + 0.6
    # no overlap: node-a's own deadline had passed before node-b became leader
    assert a_valid_until < acquired
    assert a.is_leader is False

    # the old holder finds out without an exception
    assert a.renew() is False
    assert (a.is_leader, a.term) == (False, None)
    assert a_events.kinds() == [LeaseEvent.ACQUIRED, LeaseEvent.LOST]
    assert "no longer holds our token" in a_events.last(LeaseEvent.LOST)["reason"]
    assert b.is_leader and b.renew()


def test_maintain_renews_about_every_third_of_ttl_and_is_free_otherwise(make_lease, servers, redis_prefix):
    server = servers()
    # A ttl that holds on a loaded machine: renewals every 2 s, reported late only after 4 s
    # (the loop starved for 2 s), the key lives 6 s; ttl/3 and ttl/2 are still a second apart.
    ttl = 6.0

    # "Free otherwise": a lease of its own with a long ttl, so that no renewal can fall due
    # during the 2000 calls however slowly they run on a loaded machine. Done before the lease
    # under test is taken, so that this part's duration cannot eat into that lease's ttl.
    idle, _ = make_lease("node-idle", url=server.url, ttl=60.0, name=redis_prefix + "app-idle")
    assert idle.try_acquire()
    idle_until = idle.valid_until
    with admin(server.url) as client:
        before = int(client.info("stats")["total_commands_processed"])
        started = time.monotonic()
        for _ in range(2000):
            assert idle.maintain() is True
        elapsed = time.monotonic() - started
        after = int(client.info("stats")["total_commands_processed"])
    assert after - before <= 1, "maintain() must not talk to Redis when no renewal is due"  # (the INFO itself)
    assert idle.valid_until == idle_until
    # a clock read and a comparison per call (about a millisecond for all 2000 when idle); one
    # blocking call, or a sleep per call, would take far longer than this bound
    assert elapsed < 1.0, f"2000 maintain() calls took {elapsed:.3f}s"

    lease, events = make_lease("node-a", url=server.url, ttl=ttl)
    assert lease.try_acquire()
    assert 0.0 < lease.next_renew_in() <= ttl / 3  # ttl/3 from when the command was sent

    # keep the lease for 5 renewals by calling maintain() whenever it asks to be called (bounded:
    # renewals any sparser than every ttl/3 + ttl/5 fail here); a renewal's send time is
    # valid_until - (ttl - safety_margin), so the valid_until steps are the gaps between the
    # renewals' sends, free of how late maintain() itself was woken
    deadline = time.monotonic() + 5 * (ttl / 3 + ttl / 5)
    sends = [lease.valid_until]
    while len(sends) < 6:
        assert time.monotonic() < deadline, f"fewer than 5 renewals in {5 * (ttl / 3 + ttl / 5):.0f}s: {sends}"
        assert lease.maintain() is True
        if lease.valid_until != sends[-1]:
            sends.append(lease.valid_until)
        time.sleep(min(lease.next_renew_in(), 0.05))
    gaps = [b - a for a, b in zip(sends, sends[1:])]
    assert len(gaps) >= 5, gaps
    # never before ttl/3 (maintain() is free until then), and typically right at it: the median
    # gap is far nearer ttl/3 (2 s) than ttl/2 (3 s); a late renewal would also be reported
    assert all(gap >= ttl / 3 - 1e-6 for gap in gaps), gaps
    assert statistics.median(gaps) <= ttl / 3 + 0.3, gaps
    assert events.count(LeaseEvent.RENEWED_LATE) == 0


def test_a_late_renewal_is_reported(make_lease):
    ttl = 2.0
    lease, events = make_lease("node-a", ttl=ttl)
    assert lease.try_acquire()
    time.sleep(1.45)  # more than 2/3 of ttl (1.33 s), and 0.55 s before the key could expire
    assert lease.renew() is True
    assert events.kinds() == [LeaseEvent.ACQUIRED, LeaseEvent.RENEWED_LATE]
    assert events.last(LeaseEvent.RENEWED_LATE)["since_last"] > ttl * 2 / 3
    assert lease.renew() is True  # a prompt one is not
    assert events.count(LeaseEvent.RENEWED_LATE) == 1


# ------------------------------------------------------------- the safety margin


def test_is_leader_ends_at_valid_until_when_redis_is_killed(make_lease, servers):
    server = servers()
    # a wide margin: the key's earliest expiry (valid_until + 0.8 s) is far from valid_until
    lease, events = make_lease("node-a", url=server.url, ttl=2.0, safety_margin=0.8)
    sent = time.monotonic()
    assert lease.try_acquire()
    valid_until = lease.valid_until
    assert sent + 1.2 <= valid_until <= time.monotonic() + 1.2

    server.kill()
    # Redis is gone, but until valid_until we keep believing (we could not know better)
    assert lease.renew() is True
    assert lease.is_leader is True
    # the scheduling loop keeps calling maintain(); leadership ends at valid_until
    while lease.is_leader:
        assert lease.maintain() in (True, False)
        assert time.monotonic() < valid_until + 5, "still leader long after valid_until"
        time.sleep(0.005)
    ended = time.monotonic()
    # never before valid_until; after it, at the loop's next look: well before the key could
    # expire (valid_until + safety_margin), which is when a leader that waited for Redis to
    # tell it would stop
    assert valid_until <= ended <= valid_until + lease.safety_margin / 2
    assert lease.maintain() is False
    assert lease.renew() is False
    assert events.kinds() == [LeaseEvent.ACQUIRED, LeaseEvent.REDIS_DOWN, LeaseEvent.LOST]
    assert events.last(LeaseEvent.LOST)["redis_down"] is True


def test_is_leader_ends_at_valid_until_even_while_a_renewal_hangs_on_a_frozen_redis(make_lease, servers):
    server = servers()
    # The renewal falls due at ttl/3 (0.5 s) and then hangs for socket_timeout (1.5 s), i.e. to
    # at least 2.0 s; valid_until is at ttl - safety_margin (1.0 s), a second earlier.
    lease, events = make_lease("node-a", url=server.url, ttl=1.5, safety_margin=0.5, socket_timeout=1.5)
    assert lease.try_acquire()
    valid_until = lease.valid_until
    server.freeze()  # connections stay open, nothing answers
    try:
        stop = threading.Event()
        in_maintain = {"since": None}

        def scheduling_loop():
            while not stop.is_set():
                in_maintain["since"] = time.monotonic()
                lease.maintain()
                in_maintain["since"] = None
                time.sleep(0.01)

        loop = threading.Thread(target=scheduling_loop, daemon=True)
        loop.start()
        while lease.is_leader:  # a property: reads the clock, never waits for Redis
            assert time.monotonic() < valid_until + 5, "still leader long after valid_until"
            time.sleep(0.002)
        ended = time.monotonic()
        blocked_since = in_maintain["since"]
        # it ended at valid_until: not when the hanging renewal gave up (a second later), nor when
        # the key could expire (safety_margin, 0.5 s, later)
        assert valid_until <= ended <= valid_until + lease.safety_margin / 2
        # ... and the loop was indeed blocked in a renewal sent before valid_until all along
        assert blocked_since is not None and blocked_since < valid_until, (blocked_since, valid_until)
        stop.set()
        loop.join(10)  # the renewal (and the reconnect after it) time out on their own
        assert not loop.is_alive()
    finally:
        server.thaw()
    assert lease.is_leader is False
    assert LeaseEvent.REDIS_DOWN in events.kinds()


# ------------------------------------------------------- never delete another's key


def test_release_and_step_down_by_a_non_owner_never_delete_the_holders_key(make_lease, redis_url):
    a, a_events = make_lease("node-a", ttl=0.3)
    # (node-b's holding must outlast the rest of the test, however slowly it runs)
    b, _ = make_lease("node-b", ttl=30.0)
    c, c_events = make_lease("node-c", ttl=0.3)

    assert a.try_acquire()
    # a node that never held the lease
    c.release()
    c.step_down("no reason")
    assert c_events.items == []

    # a stale holder: node-a's key expires, node-b takes over, then node-a releases
    deadline = time.monotonic() + 5
    while not b.try_acquire():
        assert time.monotonic() < deadline, "node-a's key never expired"
        time.sleep(0.01)
    with admin(redis_url) as client:
        holder_value = client.get(b.lease_key)
        assert a.term is not None  # node-a has not noticed yet
        a.release()
        assert client.get(b.lease_key) == holder_value
        assert a_events.last(LeaseEvent.RELEASED)["deleted"] is False

        assert a.try_acquire() is False
        a.step_down("stale")
        assert client.get(b.lease_key) == holder_value
    assert b.renew() is True and b.is_leader


def test_step_down_gives_the_lease_up_and_the_next_term_exceeds_the_observed_one(make_lease):
    a, a_events = make_lease("node-a")
    b, _ = make_lease("node-b")
    assert a.try_acquire()
    term = a.term

    a.step_down("claim store has term %d" % (term + 10), observed_term=term + 10)
    assert (a.is_leader, a.term) == (False, None)
    assert a_events.kinds() == [LeaseEvent.ACQUIRED, LeaseEvent.STEPPED_DOWN]
    assert a_events.last(LeaseEvent.STEPPED_DOWN)["deleted"] is True

    assert a.try_acquire() is True  # the key was deleted: free at once
    assert a.term > term + 10
    assert b.try_acquire() is False


def test_close_releases_once_and_is_idempotent(make_lease, redis_url):
    a, events = make_lease("node-a")
    assert a.try_acquire()
    a.close()
    a.close()
    a.release()
    assert events.kinds() == [LeaseEvent.ACQUIRED, LeaseEvent.RELEASED]
    with admin(redis_url) as client:
        assert client.exists(a.lease_key) == 0
    assert a.try_acquire() is False and a.wait_for_release(0.01) is False


def test_a_failing_event_handler_does_not_break_the_lease(redis_url, redis_prefix, caplog):
    def handler(event, info):
        raise RuntimeError("handler bug")

    lease = RedisLease(lambda: redis_client_from_url(redis_url), name=redis_prefix + "h", node_id="n",
                       on_event=handler)
    try:
        assert lease.try_acquire() is True
        assert "handler bug" in caplog.text
    finally:
        lease.close()
        with admin(redis_url) as client:
            client.delete(*lease_keys(redis_prefix + "h")[:2])


# ----------------------------------------------------------------- fast handover


def test_wait_for_release_wakes_within_100ms_of_a_release(make_lease):
    a, _ = make_lease("node-a")  # ttl 5 s: without a notice, a standby would wait for seconds
    b, _ = make_lease("node-b")
    assert a.try_acquire()
    assert b.try_acquire() is False

    # nothing happens: False after the timeout (not before it; and not only at the holder's
    # expiry, ~5 s away)
    started = time.monotonic()
    assert b.wait_for_release(0.3) is False
    assert 0.3 <= time.monotonic() - started < 1.5

    # Five hand-overs: the standby blocks in wait_for_release(5.0), the holder releases.
    latencies = []
    for _ in range(5):
        if a.term is None:
            assert a.try_acquire()
        woke = {}
        waiting = threading.Event()

        def standby():
            waiting.set()
            woke["result"] = b.wait_for_release(5.0)
            woke["at"] = time.monotonic()

        thread = threading.Thread(target=standby)
        thread.start()
        assert waiting.wait(5)
        time.sleep(0.05)  # (let it block; a notice sent earlier would wait in its subscription anyway)
        released = time.monotonic()
        a.release()
        thread.join(6)
        assert woke["result"] is True
        latencies.append(woke["at"] - released)
    # woken by the notice: typically within 100 ms, and every time long before the 5 s timeout
    # or the holder's expiry (a standby that missed the notice would sleep until one of them)
    assert statistics.median(latencies) < 0.1, latencies
    assert max(latencies) < 1.0, latencies
    old_term = a.term
    assert b.try_acquire() is True
    assert old_term is None and b.term is not None


def test_wait_for_release_is_true_at_once_when_the_lease_is_free(make_lease):
    b, _ = make_lease("node-b")
    started = time.monotonic()
    assert b.wait_for_release(5.0) is True  # nobody holds it: go and take it
    assert time.monotonic() - started < 1.5  # not at the timeout


def test_standby_loop_fails_over_within_ttl_and_takes_a_release_at_once(make_lease):
    """The loop a standby runs: try, then wait for a release notice or the holder's expiry."""
    ttl = 2.0
    a, _ = make_lease("node-a", ttl=ttl)
    b, _ = make_lease("node-b", ttl=ttl)

    def run_standby(lease, result, waiting=None):
        while not lease.try_acquire():
            if waiting is not None:
                waiting.set()
            lease.wait_for_release(min(lease.retry_after(), 5.0))
        result["at"] = time.monotonic()

    # node-a crashes right after acquiring (never renews, never releases)
    sent = time.monotonic()
    assert a.try_acquire()
    result: dict = {}
    thread = threading.Thread(target=run_standby, args=(b, result), daemon=True)
    thread.start()
    thread.join(3 * ttl)
    assert "at" in result, "no failover within 3 ttl"
    # not before the key can have expired; after it, at once: the standby's wait ends at the
    # holder's expiry (plus a round trip), well before a second ttl would have passed
    assert ttl <= result["at"] - sent <= ttl + 0.5
    assert a.renew() is False

    # node-b shuts down cleanly: node-a's standby loop takes over at once. (Its wait would
    # otherwise last until node-b's key expires, about 2 s after node-b acquired.)
    result = {}
    waiting = threading.Event()
    thread = threading.Thread(target=run_standby, args=(a, result, waiting), daemon=True)
    thread.start()
    assert waiting.wait(5), "node-a's standby loop never got to wait"
    time.sleep(0.1)  # (let it block in its wait)
    released = time.monotonic()
    assert released < b.valid_until - 0.5, "test set-up too slow: node-b's key is about to expire"
    b.release()
    thread.join(5)
    assert "at" in result, "node-a's standby loop never took the released lease"
    assert result["at"] - released < 0.5


# -------------------------------------------------------------- Redis trouble


def test_redis_restart_is_survived_without_exceptions(make_lease, servers):
    server = servers()
    # (a ttl long enough that node-a is surely still within valid_until when Redis is gone)
    a, a_events = make_lease("node-a", url=server.url, ttl=5.0)
    b, b_events = make_lease("node-b", url=server.url, ttl=5.0)
    assert a.try_acquire()
    term_before = a.term
    assert b.try_acquire() is False
    assert b.wait_for_release(0.05) is False  # node-b is subscribed now

    server.kill()
    # nothing raises during the outage
    assert a.renew() is True  # still within valid_until
    assert a.maintain() is True
    backoffs = []
    for _ in range(6):
        assert b.try_acquire() is False
        backoffs.append(b.retry_after())
    # exponential back-off (0.1 s doubling, with jitter) up to 2 s
    assert backoffs[:5] == sorted(backoffs[:5]) and backoffs[0] <= 0.1
    assert 1.0 <= backoffs[-1] <= 2.0 and max(backoffs) <= 2.0
    started = time.monotonic()
    assert b.wait_for_release(0.3) is False
    # it sleeps out its timeout (not less), not the 2 s of a full back-off
    assert 0.3 <= time.monotonic() - started < 1.5
    assert b.wait_for_release(0.05) is False
    # one REDIS_DOWN per outage, however many failed calls
    assert a_events.count(LeaseEvent.REDIS_DOWN) == 1
    assert b_events.count(LeaseEvent.REDIS_DOWN) == 1

    server.start()  # same port, empty data set (no persistence)
    # node-a's key is gone with the restart: its renewal says so
    assert a.renew() is False
    assert a_events.kinds()[-2:] == [LeaseEvent.REDIS_BACK, LeaseEvent.LOST]
    # acquisition works again; the term counter was lost but terms still rise
    assert a.try_acquire() is True
    assert a.term > term_before
    # node-b re-subscribes on the restarted server and sees node-a's release
    woke = {}
    thread = threading.Thread(target=lambda: woke.update(result=b.wait_for_release(5.0), at=time.monotonic()))
    thread.start()
    time.sleep(0.3)  # (if it has not subscribed yet, it finds the lease free: True at once too)
    released = time.monotonic()
    a.release()
    thread.join(6)
    # node-a's key had 5 s to live: a standby deaf to the restarted server's notices would
    # sleep until then
    assert woke["result"] is True and woke["at"] - released < 1.0, (woke, released)
    assert b.try_acquire() is True and b.term > term_before
    assert b_events.count(LeaseEvent.REDIS_BACK) == 1
    assert b_events.count(LeaseEvent.REDIS_DOWN) == 1


def test_an_acquisition_whose_reply_was_lost_is_recovered_not_locked_out(make_lease, servers):
    """Redis ran our script but the reply came too late: the next attempt finds the holding."""
    server = servers()
    a, a_events = make_lease("node-a", url=server.url, ttl=5.0, socket_timeout=0.3)
    b, _ = make_lease("node-b", url=server.url, ttl=5.0)
    assert a.try_acquire()
    a.release()  # (the scripts are now cached in the server)

    # Redis busy for 2 s: a's acquisition, sent while it is busy, times out after 0.3 s and is
    # run by Redis when the script ends, long after a gave up on it.
    busy = """local s = redis.call('TIME')
              while true do
                local n = redis.call('TIME')
                if (n[1] - s[1]) * 1000000 + (n[2] - s[2]) > 2000000 then break end
              end
              return s"""
    with admin(server.url) as client:
        ran = {}
        sending = threading.Event()

        def block():
            sending.set()
            ran["start"] = client.eval(busy, 0)

        blocker = threading.Thread(target=block)
        blocker.start()
        assert sending.wait(5)
        time.sleep(0.2)  # (the EVAL is on its way: give Redis time to start it)
        tried = time.time()
        acquired = a.try_acquire()  # times out after 0.3 s; Redis runs it at 2 s
        blocker.join()
        started_at = int(ran["start"][0]) + int(ran["start"][1]) / 1e6  # Redis' clock, the same machine's
        assert started_at < tried, "test set-up too slow: Redis was not busy yet when node-a tried"
        assert acquired is False
        deadline = time.monotonic() + 2
        while client.get(a.lease_key) is None:  # Redis may answer this GET first
            assert time.monotonic() < deadline, "Redis never ran the timed-out acquisition"
            time.sleep(0.01)
        value = client.get(a.lease_key).decode()
    assert value.endswith(":node-a")
    assert b.try_acquire() is False
    assert a.try_acquire() is True  # not locked out for 5 s by our own key
    assert value.split(":")[1] == str(a.term)
    assert a_events.kinds()[-3:] == [LeaseEvent.REDIS_DOWN, LeaseEvent.REDIS_BACK, LeaseEvent.ACQUIRED]


def test_errors_never_show_the_password(make_lease, caplog):
    closed_port = free_port()
    lease, events = make_lease("node-a", url=f"redis://:hunter2secret@127.0.0.1:{closed_port}/0")
    caplog.set_level(logging.DEBUG, logger="celery_cluster_beat")
    assert lease.try_acquire() is False
    assert lease.wait_for_release(0.01) is False
    assert events.count(LeaseEvent.REDIS_DOWN) == 1
    assert "hunter2secret" not in caplog.text
    assert "hunter2secret" not in repr(events.items)
    with pytest.raises(ValueError) as excinfo:
        redis_client_from_url("redis://:hunter2secret@127.0.0.1:notaport/0")
    assert "hunter2secret" not in str(excinfo.value) and "***" in str(excinfo.value)


# ------------------------------------------------------------------ Redis Cluster


@pytest.mark.parametrize("name", ["proj", "my.celery.app", "a:b:c", "x{y", "ünïcode"])
def test_lease_key_term_counter_and_channel_share_one_cluster_slot(name):
    lease = RedisLease(lambda: None, name=name, node_id="n")
    keys = (lease.lease_key, lease.term_key, lease.channel)
    assert keys == lease_keys(name)
    assert keys[0] == f"cluster_beat:{{{name}}}:lease"
    assert keys[1] == f"cluster_beat:{{{name}}}:term"
    assert keys[2] == f"cluster_beat:{{{name}}}:released"
    assert len({key_slot(key.encode()) for key in keys}) == 1


# ------------------------------------------------------------ connection flavours


def test_client_settings_never_block_for_long(redis_url):
    client = redis_client_from_url(redis_url + "?socket_timeout=300", socket_timeout=1.5)
    try:
        kwargs = client.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] == 1.5 and kwargs["socket_connect_timeout"] == 1.5
        assert kwargs["health_check_interval"] > 0
        assert kwargs["retry"].get_retries() <= 1
        assert client.ping()
    finally:
        client.close()


def test_unix_socket(make_lease, servers, tmp_path):
    path = tmp_path / "redis.sock"
    servers("--unixsocket", str(path), "--unixsocketperm", "700")
    lease, _ = make_lease("node-a", url=f"unix://{path}?db=0")
    assert lease.try_acquire() and lease.renew()
    lease.release()


def start_sentinel(servers, tmp_path, master: RedisServer, password: Optional[str] = None) -> RedisServer:
    port = free_port()
    conf = tmp_path / f"sentinel-{port}.conf"
    lines = [
        f"port {port}",
        "bind 127.0.0.1",
        f"dir {tmp_path}",
        f"sentinel monitor mymaster 127.0.0.1 {master.port} 1",
        "sentinel down-after-milliseconds mymaster 60000",
    ]
    if password:
        lines.append(f"sentinel auth-pass mymaster {password}")
    conf.write_text("\n".join(lines) + "\n")
    sentinel = servers(port=port, sentinel=True, conf=conf)
    with redis.Redis(port=port, socket_timeout=2) as client:
        deadline = time.monotonic() + 10
        while client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", "mymaster") is None:
            if time.monotonic() > deadline:
                pytest.fail("redis-server --sentinel did not learn the master within 10 s", pytrace=False)
            time.sleep(0.05)
    return sentinel


def test_sentinel_url_reaches_the_master_and_a_lease_works_through_it(make_lease, servers, tmp_path):
    master = servers("--requirepass", "s3cretpw", client_kwargs={"password": "s3cretpw"})
    try:
        sentinel = start_sentinel(servers, tmp_path, master, password="s3cretpw")
    except Exception as exc:  # pragma: no cover - environment problem, say so
        pytest.fail(f"could not run `redis-server --sentinel` here: {exc}", pytrace=False)
    url = f"sentinel://:s3cretpw@127.0.0.1:{sentinel.port}"

    client = redis_client_from_url(url, transport_options={"master_name": "mymaster"})
    try:
        assert isinstance(client.connection_pool, SentinelConnectionPool)
        assert client.connection_pool.connection_class is SentinelManagedConnection
        assert client.ping()
        assert int(client.info("server")["tcp_port"]) == master.port
    finally:
        client.close()

    # the master name may also come from the URL; a dead sentinel listed first is skipped
    dead = free_port()
    url2 = f"sentinel://:s3cretpw@127.0.0.1:{dead};sentinel://127.0.0.1:{sentinel.port}?master_name=mymaster"
    a, a_events = make_lease("node-a", url=url2)
    b, _ = make_lease("node-b", url=url, transport_options={"master_name": "mymaster"})
    assert a.try_acquire() and b.try_acquire() is False
    assert a.renew()
    a.release()
    assert b.try_acquire() and b.term > a_events.last(LeaseEvent.ACQUIRED)["term"]

    # a wrong master name is an outage, not an exception
    c, c_events = make_lease("node-c", url=url, transport_options={"master_name": "nosuchmaster"})
    assert c.try_acquire() is False
    assert c_events.kinds() == [LeaseEvent.REDIS_DOWN]

    with pytest.raises(ValueError, match="master_name"):
        redis_client_from_url(url)


def test_sentinel_with_tls_options_uses_the_ssl_sentinel_connection():
    client = redis_client_from_url(
        "sentinel://127.0.0.1:26379", transport_options={"master_name": "m"},
        ssl={"ssl_cert_reqs": "CERT_REQUIRED", "ssl_ca_certs": "/etc/ca.pem"},
    )
    kwargs = client.connection_pool.connection_kwargs
    assert client.connection_pool.connection_class is SentinelManagedSSLConnection
    assert kwargs["ssl_cert_reqs"] == ssl.CERT_REQUIRED and kwargs["ssl_ca_certs"] == "/etc/ca.pem"
    client.close()


def test_rediss_builds_an_ssl_client_with_the_cert_options():
    client = redis_client_from_url(
        "rediss://:pw@redis.example:6380/2?ssl_cert_reqs=CERT_REQUIRED&ssl_ca_certs=/etc/ca.pem"
        "&ssl_check_hostname=false"
    )
    pool = client.connection_pool
    assert pool.connection_class is redis.SSLConnection
    kwargs = pool.connection_kwargs
    assert kwargs["ssl_cert_reqs"] == ssl.CERT_REQUIRED
    assert kwargs["ssl_ca_certs"] == "/etc/ca.pem"
    assert kwargs["ssl_check_hostname"] is False
    assert (kwargs["host"], kwargs["port"], kwargs["db"], kwargs["password"]) == ("redis.example", 6380, 2, "pw")

    # Celery's broker_use_ssl dict; also turns TLS on for a redis:// URL (kombu does the same)
    client = redis_client_from_url(
        "redis://redis.example:6379/0",
        ssl={"ssl_cert_reqs": ssl.CERT_OPTIONAL, "ssl_certfile": "/c.pem", "keyfile": "/k.pem"},
    )
    kwargs = client.connection_pool.connection_kwargs
    assert client.connection_pool.connection_class is redis.SSLConnection
    assert (kwargs["ssl_cert_reqs"], kwargs["ssl_certfile"], kwargs["ssl_keyfile"]) == (
        ssl.CERT_OPTIONAL, "/c.pem", "/k.pem")

    # ssl_* transport options complete a rediss:// URL; the URL's query wins
    client = redis_client_from_url(
        "rediss://redis.example/0?ssl_cert_reqs=none",
        transport_options={"ssl_ca_certs": "/t.pem", "ssl_cert_reqs": "required", "visibility_timeout": 3600},
    )
    kwargs = client.connection_pool.connection_kwargs
    assert (kwargs["ssl_cert_reqs"], kwargs["ssl_ca_certs"]) == (ssl.CERT_NONE, "/t.pem")

    for bad in ("redis://h/0?ssl_cert_reqs=CERT_NONE", "rediss://h/0?ssl_cert_reqs=sometimes"):
        with pytest.raises(ValueError):
            redis_client_from_url(bad)
    with pytest.raises(ValueError, match="unknown TLS option"):
        redis_client_from_url("redis://h/0", ssl={"cert_reqs": "none", "verify": True})


def test_rediss_against_a_real_tls_redis(make_lease, servers, tmp_path):
    if shutil.which("openssl") is None:
        pytest.fail("openssl is not on PATH; it generates the test certificate", pytrace=False)
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
         "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )
    tls_kwargs = {"ssl": True, "ssl_ca_certs": str(cert)}
    port = free_port()
    server = servers("--tls-port", str(port), "--tls-cert-file", str(cert), "--tls-key-file", str(key),
                     "--tls-ca-cert-file", str(cert), "--tls-auth-clients", "no",
                     tls=True, port=port, client_kwargs=tls_kwargs)
    url = f"rediss://127.0.0.1:{server.port}/0?ssl_cert_reqs=CERT_REQUIRED&ssl_ca_certs={cert}"
    lease, _ = make_lease("node-a", url=url)
    assert lease.try_acquire() and lease.renew()
    lease.release()

    # a certificate we cannot verify is an outage of the lease, not an exception
    untrusted, events = make_lease("node-b", url=f"rediss://127.0.0.1:{server.port}/0?ssl_cert_reqs=CERT_REQUIRED")
    assert untrusted.try_acquire() is False
    assert events.kinds() == [LeaseEvent.REDIS_DOWN]
