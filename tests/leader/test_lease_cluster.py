"""The leader lease on a real Redis Cluster (``redis+cluster://``).

One cluster of six ``redis-server --cluster-enabled yes`` processes per module (three
masters, one replica each; ``tests/redis_cluster.py``), made whole again before each
test. Every test names its lease after itself; the lease keys share one hash slot, so
they live on one master. The tests kill that master (SIGKILL: its replica is promoted),
fail it over gracefully (``CLUSTER FAILOVER``: the clients then get ``MOVED``), or freeze
it, and check what the lease promises: one holder at a time with rising terms, a clean
release handed over at once, a leader again within a bound after the master dies, no
exception, and no call that blocks for long.
"""
from __future__ import annotations

import random
import signal
import statistics
import threading
import time
import uuid
from typing import List, Optional

import pytest
from redis.exceptions import RedisClusterException

from celery_cluster_beat.config import load_settings
from celery_cluster_beat.errors import ConfigError
from celery_cluster_beat.leader.channels import NoticeTransport
from celery_cluster_beat.leader.clusterconn import ClusterClient, is_cluster
from celery_cluster_beat.leader.lease import LeaseEvent, RedisLease
from celery_cluster_beat.leader.notices import ChangeNotices
from celery_cluster_beat.leader.redisconn import redis_client_from_url
from celery_cluster_beat.leader.urls import mask_url
from redis_cluster import RedisClusterNodes, free_port

TTL = 3.0
SOCKET_TIMEOUT = TTL / 2  # what the settings give a 3 s ttl (min(2 s, ttl/2))


class Events:
    def __init__(self) -> None:
        self.items: List[tuple] = []

    def __call__(self, event: LeaseEvent, info: dict) -> None:
        self.items.append((event, info, time.monotonic()))

    def count(self, event: LeaseEvent) -> int:
        return sum(1 for e, _, _ in self.items if e is event)


@pytest.fixture
def make_lease(request):
    """``make_lease(node_id, url, **kwargs) -> (lease, events)`` under a lease name of the test's own."""
    leases: List[RedisLease] = []
    name = f"{request.node.name[:40]}-{uuid.uuid4().hex[:6]}"

    def make(node_id: str, url: str, *, ttl: float = TTL, socket_timeout: float = SOCKET_TIMEOUT, **kwargs):
        events = Events()
        lease = RedisLease(lambda: redis_client_from_url(url, socket_timeout=socket_timeout),
                           name=name, node_id=node_id, ttl=ttl, on_event=events, **kwargs)
        leases.append(lease)
        return lease, events

    yield make
    for lease in leases:
        lease.close()


class Replica(threading.Thread):
    """The loop a beat replica runs around its lease: lead while it can, else stand by.

    Records each holding as [term, node, start, end] (monotonic; ``end`` is when the node
    stopped believing it leads: the return of the call that told it, or its
    ``valid_until``), and any exception that escaped the lease.
    """

    def __init__(self, lease: RedisLease, holdings: list, stop: threading.Event,
                 hold: Optional[tuple] = None) -> None:
        super().__init__(daemon=True, name=f"replica-{lease.node_id}")
        self.lease, self.holdings, self.stop_event, self.hold = lease, holdings, stop, hold
        self.errors: List[BaseException] = []
        self.current: Optional[list] = None

    def _end(self, at: float) -> None:
        if self.current is not None:
            self.current.append(at)
            self.holdings.append(self.current)
            self.current = None

    def run(self) -> None:
        lease = self.lease
        last_valid = 0.0  # valid_until of the last grant: the holder stops believing at it at the latest
        try:
            while not self.stop_event.is_set():
                if lease.try_acquire():  # (maintain() while holding)
                    last_valid = lease.valid_until
                    if self.current is None:
                        self.current = [lease.term, lease.node_id, time.monotonic()]
                        if self.hold is not None:  # hold a while, then hand over cleanly
                            time.sleep(random.uniform(*self.hold))
                            if lease.maintain():
                                self._end(time.monotonic())
                                lease.release()
                                self.stop_event.wait(0.1)  # (as a restarting node: the others get a chance)
                            else:
                                self._end(min(time.monotonic(), last_valid))
                            continue
                    time.sleep(min(0.05, lease.next_renew_in()))
                    continue
                self._end(min(time.monotonic(), last_valid))
                lease.wait_for_release(min(1.0, max(0.05, lease.retry_after())))
            self._end(time.monotonic())
            lease.release()
        except BaseException as exc:  # pragma: no cover - reported by the test
            self.errors.append(exc)


def check_holdings(holdings: list) -> None:
    """One holder at a time, and each holding's term above the one before."""
    ordered = sorted(holdings, key=lambda h: h[2])
    for before, after in zip(ordered, ordered[1:]):
        assert after[2] >= before[3], f"two holders at once: {before} and {after}"
        assert after[0] > before[0], f"term did not rise: {before} then {after}"


def leader_since(leases: List[RedisLease], since: float) -> Optional[RedisLease]:
    """A lease that leads on a grant Redis gave after *since* (an acquisition or a renewal)."""
    for lease in leases:
        holding = lease._holding
        if lease.is_leader and holding is not None and holding.last_renewed > since:
            return lease
    return None


# ------------------------------------------------------------------ URL and settings (no server)


def test_cluster_urls_build_a_client_that_connects_on_first_use_and_bad_ones_name_the_problem():
    port = free_port()  # nothing listens there
    started = time.monotonic()
    client = redis_client_from_url(f"redis+cluster://user:s3cret@127.0.0.1:{port}", socket_timeout=0.5)
    assert isinstance(client, ClusterClient) and is_cluster(client)
    assert time.monotonic() - started < 0.1, "building the client must not connect"
    assert "s3cret" not in repr(client) and "***" in repr(client)
    with pytest.raises(RedisClusterException) as failed:
        client.ping()
    assert "s3cret" not in str(failed.value)
    client.close()

    masked = mask_url("redis+cluster://u:s3cret@h:7000;redis+cluster://:x%40y@h2:7001?password=p2")
    assert masked == "redis+cluster://u:***@h:7000;redis+cluster://:***@h2:7001?password=***"

    seeds = redis_client_from_url("redis+cluster://:pw@10.0.0.1:7000;redis+cluster://10.0.0.2", socket_timeout=1.0)
    assert seeds._startup_nodes == [("10.0.0.1", 7000), ("10.0.0.2", 6379)]
    assert seeds._kwargs["password"] == "pw" and seeds._kwargs["socket_timeout"] == 1.0
    assert seeds._kwargs["socket_connect_timeout"] == 1.0
    tls = redis_client_from_url("rediss+cluster://h:7000?ssl_cert_reqs=none", socket_timeout=1.0)
    assert tls._kwargs["ssl"] is True

    for bad, says in [
        ("redis+cluster://:s3cret@h:7000/2", "database 0 only"),
        ("redis+cluster://:s3cret@h:7000?bogus=1", "bogus"),
        ("redis+cluster://:s3cret@h:7000;redis://h2", "every ';'-separated part"),
        ("rediss+cluster://:s3cret@h;redis+cluster://h2", "mixes"),
        ("redis+cluster://:s3cret@h?ssl_cert_reqs=none", "rediss+cluster://"),
        ("redis+cluster://:s3cret@h:99999", "malformed URL"),
    ]:
        with pytest.raises(ValueError) as refused:
            redis_client_from_url(bad, socket_timeout=1.0)
        assert says in str(refused.value) and "s3cret" not in str(refused.value), str(refused.value)


def _conf(**settings):
    from celery import Celery

    app = Celery("cluster-settings-test", broker="memory://")
    app.conf.update(settings)
    return app.conf


def test_settings_take_a_cluster_url_and_refuse_a_bad_one_naming_the_setting():
    s = load_settings(_conf(cluster_beat_redis_url="redis+cluster://:pw@127.0.0.1:7000", cluster_beat_lock_ttl=3),
                      has_result_backend=lambda: False)
    assert s.redis_url.startswith("redis+cluster://") and "pw" not in repr(s)
    client = s.redis.client()  # the client the lease will build: same time-outs as a single Redis's
    assert isinstance(client, ClusterClient) and client._kwargs["socket_timeout"] == 1.5
    with pytest.raises(ConfigError) as refused:
        load_settings(_conf(cluster_beat_redis_url="redis+cluster://:pw@127.0.0.1:7000/3"),
                      has_result_backend=lambda: False)
    assert "setting cluster_beat_redis_url" in str(refused.value) and ":pw@" not in str(refused.value)


# ------------------------------------------------------------------ the lease on a whole cluster


def test_acquire_renew_release_on_the_master_of_the_lease_slot(redis_cluster: RedisClusterNodes, make_lease):
    a, a_events = make_lease("node-a", redis_cluster.url)
    b, _ = make_lease("node-b", redis_cluster.seeds_url)

    assert a.try_acquire() is True and a.is_leader
    assert b.try_acquire() is False and b.holder == "node-a"
    first = a.term

    # the keys are where the hash tag puts them: on the master serving their slot
    master = redis_cluster.master_of(a.lease_key)
    assert redis_cluster.master_of(a.term_key) == master == redis_cluster.master_of(a.channel)
    node = redis_cluster.node(master)
    try:
        assert node.get(a.lease_key).endswith(f":{first}:node-a")
        assert int(node.get(a.term_key)) == first
        node.pexpire(a.lease_key, 500)  # (as if time passed) a renewal restores the full ttl
        assert a.renew() is True
        assert node.pttl(a.lease_key) > TTL * 1000 - 500
    finally:
        node.close()

    # the cluster client's nodes have the single client's time-outs
    single = redis_client_from_url("redis://127.0.0.1:6379", socket_timeout=SOCKET_TIMEOUT)
    node_kwargs = a._client.cluster.nodes_manager.connection_kwargs
    for key in ("socket_timeout", "socket_connect_timeout"):
        assert node_kwargs[key] == single.connection_pool.connection_kwargs[key] == SOCKET_TIMEOUT
    single.close()

    a.release()
    assert a_events.count(LeaseEvent.RELEASED) == 1 and not a.is_leader
    assert b.try_acquire() is True and b.term > first
    assert a.try_acquire() is False and a.holder == "node-b"


def test_only_one_holder_at_a_time_among_five_contenders(redis_cluster, make_lease):
    stop = threading.Event()
    holdings: list = []
    replicas = [Replica(make_lease(f"node-{i}", redis_cluster.url, ttl=1.0, socket_timeout=0.5)[0], holdings, stop,
                        hold=(0.05, 0.25)) for i in range(5)]
    for replica in replicas:
        replica.start()
    # At least 4 s of contention, and until the lease has changed hands 8 times (20 s at most: a
    # starved test process hands over more slowly, not less correctly).
    started = time.monotonic()
    while time.monotonic() - started < 4.0 or (len(holdings) < 8 and time.monotonic() - started < 20.0):
        time.sleep(0.1)
    stop.set()
    for replica in replicas:
        replica.join(5)
    assert not [r.errors for r in replicas if r.errors]
    check_holdings(holdings)
    assert len(holdings) >= 8, holdings
    assert len({h[1] for h in holdings}) >= 3, "the lease went round several nodes"


def test_a_clean_release_wakes_a_waiting_standby_at_once(redis_cluster, make_lease):
    a, _ = make_lease("node-a", redis_cluster.url, ttl=5.0)
    b, _ = make_lease("node-b", redis_cluster.url, ttl=5.0)
    assert a.try_acquire() and b.try_acquire() is False
    started = time.monotonic()
    assert b.wait_for_release(0.3) is False
    assert 0.3 <= time.monotonic() - started < 1.5
    assert b.notice_transport is NoticeTransport.SHARDED

    latencies = []
    for _ in range(5):
        if a.term is None:
            assert a.try_acquire()
        woke: dict = {}
        waiting = threading.Event()

        def standby():
            waiting.set()
            woke["result"] = b.wait_for_release(5.0)
            woke["at"] = time.monotonic()

        thread = threading.Thread(target=standby)
        thread.start()
        assert waiting.wait(5)
        time.sleep(0.05)
        released = time.monotonic()
        a.release()
        thread.join(6)
        assert woke["result"] is True
        latencies.append(woke["at"] - released)
    # woken by the sharded notice, not by the 5 s timeout or the holder's expiry
    assert statistics.median(latencies) < 0.1, latencies
    assert max(latencies) < 1.0, latencies
    assert b.try_acquire() is True


def test_schedule_change_notices_are_heard_through_sharded_pubsub(redis_cluster):
    name = f"notices-{uuid.uuid4().hex[:6]}"
    leader = ChangeNotices(lambda: redis_client_from_url(redis_cluster.url, socket_timeout=1.0), name)
    writer = ChangeNotices(lambda: redis_client_from_url(redis_cluster.seeds_url, socket_timeout=1.0), name)
    try:
        assert leader.heard() is True, "a fresh subscription asks for a read"
        assert leader._pubsub.transport is NoticeTransport.SHARDED and leader.down is False
        assert leader.heard() is False
        writer.publish(7)
        deadline = time.monotonic() + 2
        while not leader.heard():
            assert time.monotonic() < deadline, "the notice never arrived"
            time.sleep(0.02)
        assert leader.heard() is False
    finally:
        leader.close()
        writer.close()


# ------------------------------------------------------------------ the slot's master fails


def test_a_client_made_after_its_only_seed_died_finds_the_cluster_through_nodes_learnt_before(redis_cluster):
    """Beat makes several clients of one URL (lease, change notices, status page): a later one
    must not depend on the URL's one seed being alive."""
    key = f"probe-{uuid.uuid4().hex[:6]}"
    first = redis_client_from_url(redis_cluster.url, socket_timeout=1.0)
    assert first.set(key, "1")
    first.close()
    seed = redis_cluster.ports[0]
    redis_cluster.kill(seed)
    redis_cluster.wait_ok(30)  # (a replica took over if the seed was a master)
    later = redis_client_from_url(redis_cluster.url, socket_timeout=1.0)
    try:
        assert later.get(key) == b"1"
    finally:
        later.close()
    assert f":{seed}" in redis_cluster.url




@pytest.mark.timeout(90)
def test_master_of_the_lease_slot_killed_replica_promoted_leader_again_never_two(redis_cluster, make_lease):
    stop = threading.Event()
    holdings: list = []
    made = [make_lease(f"node-{i}", redis_cluster.url) for i in range(3)]
    leases = [lease for lease, _ in made]
    replicas = [Replica(lease, holdings, stop) for lease in leases]
    for replica in replicas:
        replica.start()
    try:
        deadline = time.monotonic() + 10
        while leader_since(leases, 0.0) is None:
            assert time.monotonic() < deadline, "no leader on a whole cluster"
            time.sleep(0.05)
        time.sleep(TTL)  # a few renewals: the term counter and the key reached the replica

        master = redis_cluster.master_of(leases[0].lease_key)
        killed = time.monotonic()
        redis_cluster.kill(master)
        while leader_since(leases, killed) is None:
            assert time.monotonic() - killed < 30, "no leader within 30 s of the master's death"
            time.sleep(0.05)
        again = time.monotonic() - killed
        promoted = redis_cluster.master_of(leases[0].lease_key)
        time.sleep(TTL)  # the leadership holds on the new master
    finally:
        stop.set()
        for replica in replicas:
            replica.join(10)
    print(f"master {master} killed: the lease granted again {again:.2f} s later (on {promoted})")
    assert promoted != master
    assert not [r.errors for r in replicas if r.errors]
    check_holdings(holdings)
    # The bound: the replica is promoted within a few node time-outs (1 s here), then at worst the
    # holder's key runs out (one ttl) and a standby's back-off (2 s) passes.
    assert again < 6 + TTL + 2 + 3, again
    down = sum(events.count(LeaseEvent.REDIS_DOWN) for _, events in made)
    assert down >= 1, "the outage was noticed (and survived)"


@pytest.mark.timeout(90)
def test_a_graceful_failover_moves_the_slot_and_the_holder_keeps_the_lease(redis_cluster, make_lease):
    a, a_events = make_lease("node-a", redis_cluster.url)
    b, _ = make_lease("node-b", redis_cluster.url)
    holder_stop, standby_stop = threading.Event(), threading.Event()
    holdings: list = []
    holder = Replica(a, holdings, holder_stop)
    holder.start()
    deadline = time.monotonic() + 10
    while not a.is_leader:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    standby = Replica(b, holdings, standby_stop)
    standby.start()
    try:
        time.sleep(1.0)
        master = redis_cluster.master_of(a.lease_key)
        replica = redis_cluster.replica_of(master)
        node = redis_cluster.node(replica)
        try:
            node.execute_command("CLUSTER FAILOVER")
        finally:
            node.close()
        deadline = time.monotonic() + 20
        while redis_cluster.master_of(a.lease_key) != replica:
            assert time.monotonic() < deadline, "CLUSTER FAILOVER did not complete"
            time.sleep(0.05)
        moved = time.monotonic()
        # the holder's next renewals go to the old master, get MOVED, and follow it
        while leader_since([a], moved) is None:
            assert time.monotonic() - moved < TTL, "the holder did not renew on the new master"
            time.sleep(0.05)
        assert a_events.count(LeaseEvent.LOST) == 0, a_events.items
        time.sleep(2.5)  # the standby notices its subscription ended and subscribes on the new master
        # a clean release is still handed over at once
        stop_holder = time.monotonic()
        holder_stop.set()  # node-a shuts down: it releases the lease
        holder.join(5)
        while not b.is_leader:
            assert time.monotonic() - stop_holder < 1.0, "the standby did not take the released lease at once"
            time.sleep(0.01)
    finally:
        holder_stop.set()
        standby_stop.set()
        holder.join(5)
        standby.join(5)
    assert not holder.errors and not standby.errors
    check_holdings(holdings)


@pytest.mark.timeout(90)
def test_no_call_blocks_long_while_the_slot_master_is_frozen(redis_cluster, make_lease):
    a, a_events = make_lease("node-a", redis_cluster.url, socket_timeout=0.5)
    b, b_events = make_lease("node-b", redis_cluster.url, socket_timeout=0.5)
    assert a.try_acquire() and b.try_acquire() is False
    master = redis_cluster.master_of(a.lease_key)
    proc = redis_cluster.procs[master]
    proc.send_signal(signal.SIGSTOP)
    try:
        for call in (a.renew, b.try_acquire, a.renew):
            started = time.monotonic()
            call()
            took = time.monotonic() - started
            # one time-out (not retried), plus at most a re-read of the topology elsewhere
            print(f"{call.__qualname__} took {took:.3f} s")
            assert took < 0.5 + 0.5 + 0.5, (call, took)
        started = time.monotonic()
        assert b.wait_for_release(1.0) is False
        assert time.monotonic() - started < 1.0 + 0.5 + 0.5
    finally:
        proc.send_signal(signal.SIGCONT)
    assert a_events.count(LeaseEvent.REDIS_DOWN) == 1 and b_events.count(LeaseEvent.REDIS_DOWN) == 1


# ------------------------------------------------------------------ a cluster without sharded pub/sub


@pytest.fixture(scope="module")
def cluster_without_sharded_pubsub(tmp_path_factory):
    """Three masters whose SSUBSCRIBE and SPUBLISH are renamed away: what a cluster before Redis 7 offers."""
    off = uuid.uuid4().hex[:8]
    nodes = RedisClusterNodes(tmp_path_factory.mktemp("cluster-no-sharded"), masters=3, replicas=0,
                              extra_config=["--rename-command", "SSUBSCRIBE", f"ssubscribe-{off}",
                                            "--rename-command", "SPUBLISH", f"spublish-{off}"])
    try:
        nodes.start()
        yield nodes
    finally:
        nodes.stop()


def test_without_sharded_pubsub_a_standby_looks_at_the_key_and_still_takes_a_release_fast(
        cluster_without_sharded_pubsub, make_lease):
    url = cluster_without_sharded_pubsub.url
    a, _ = make_lease("node-a", url, ttl=5.0)
    b, _ = make_lease("node-b", url, ttl=5.0)
    assert a.try_acquire() and b.try_acquire() is False
    started = time.monotonic()
    assert b.wait_for_release(0.5) is False
    assert 0.5 <= time.monotonic() - started < 1.5
    assert b.notice_transport is NoticeTransport.POLL

    latencies = []
    for _ in range(3):
        if a.term is None:
            assert a.try_acquire()
        woke: dict = {}
        thread = threading.Thread(target=lambda: woke.update(result=b.wait_for_release(5.0), at=time.monotonic()))
        thread.start()
        time.sleep(0.3)
        released = time.monotonic()
        a.release()  # the script's SPUBLISH fails inside pcall: the key is deleted all the same
        thread.join(6)
        assert woke["result"] is True
        latencies.append(woke["at"] - released)
    # found by looking at the key every 0.2 s, not at the 5 s timeout or the holder's expiry
    assert max(latencies) < 1.0, latencies
    assert b.try_acquire() is True

    name = f"notices-{uuid.uuid4().hex[:6]}"
    notices = ChangeNotices(lambda: redis_client_from_url(url, socket_timeout=1.0), name)
    try:
        assert notices.heard() is True  # read the counter once...
        assert notices.down is True  # ...then every second: nothing can be heard here
        assert notices.heard() is False and notices._pubsub.transport is NoticeTransport.POLL
        notices.publish(3)  # never raises
    finally:
        notices.close()
