from __future__ import annotations

import os
import sys
import uuid

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import parallel  # noqa: E402
import services  # noqa: E402


def pytest_configure(config):
    parallel.configure(config)  # xdist: longest tests first, shared wide fixtures on one worker


def _or_fail(get, *args):
    """*get(*args)*, or the test fails saying which service to start (never a skip)."""
    try:
        return get(*args)
    except services.ServiceUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)


def _held(cm):
    """Yield what the context manager *cm* gives (a fresh database, a vhost), or fail as above."""
    value = _or_fail(cm.__enter__)
    try:
        yield value
    finally:
        cm.__exit__(None, None, None)


@pytest.fixture(scope="session")
def redis_url() -> str:
    return _or_fail(services.redis_url)


@pytest.fixture
def redis_prefix() -> str:
    """A key prefix of the test's own, so parallel suites do not collide."""
    return "ccbtest:" + uuid.uuid4().hex[:10] + ":"


def _db(kind: str, tmp_path):
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path}/claims.sqlite3"
        return
    yield from _held(services.fresh_database(kind))


@pytest.fixture(params=["sqlite", "postgresql", "mysql"])
def db_url(request, tmp_path):
    """An empty claim database of each supported dialect, a real server for two of them."""
    yield from _db(request.param, tmp_path)


@pytest.fixture
def pg_url(tmp_path):
    yield from _db("postgresql", tmp_path)


@pytest.fixture
def mysql_url(tmp_path):
    yield from _db("mysql", tmp_path)


@pytest.fixture
def throwaway_redis(tmp_path):
    """A redis-server of the test's own (no persistence), which the test may kill and restart."""
    from procs import ThrowawayRedis

    server = ThrowawayRedis(tmp_path)
    server.start()
    yield server
    server.kill()


@pytest.fixture
def cluster_factory(tmp_path):
    """``make(app) -> Cluster`` (with a running Watcher); every process and watcher is stopped at the end."""
    from cluster import Cluster, Watcher

    made = []

    def make(app):
        watcher = Watcher(app).__enter__()
        cluster = Cluster(app, tmp_path, watcher)
        made.append(cluster)
        return cluster

    yield make
    for cluster in made:
        cluster.stop_all()
        cluster.watcher.__exit__(None, None, None)


@pytest.fixture(scope="session")
def rabbitmq_url() -> str:
    """A RabbitMQ that completes an AMQP login (started when down; see services.rabbitmq_url)."""
    return _or_fail(services.rabbitmq_url)


@pytest.fixture
def rabbitmq_vhost(rabbitmq_url) -> str:
    """The broker URL of a RabbitMQ vhost of the test's own, deleted (with everything in it) at the end."""
    yield from _held(services.fresh_vhost(rabbitmq_url))


@pytest.fixture(scope="module")
def redis_cluster_nodes(tmp_path_factory):
    """A real Redis Cluster on loopback (3 masters, 1 replica each; see redis_cluster.py), one per test module."""
    from redis_cluster import ClusterUnavailable, RedisClusterNodes

    nodes = None
    try:
        nodes = RedisClusterNodes(tmp_path_factory.mktemp("redis-cluster"))
        nodes.start()
    except ClusterUnavailable as exc:
        if nodes is not None:
            nodes.stop()
        pytest.fail(str(exc), pytrace=False)
    try:
        yield nodes
    finally:
        nodes.stop()


@pytest.fixture
def redis_cluster(redis_cluster_nodes):
    """The module's Redis Cluster, whole again (killed nodes restarted, ``cluster_state:ok``) for each test."""
    try:
        redis_cluster_nodes.heal()
    except Exception as exc:
        pytest.fail(f"the Redis Cluster of this module could not be healed: {exc}", pytrace=False)
    return redis_cluster_nodes
