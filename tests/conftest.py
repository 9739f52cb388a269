from __future__ import annotations

import os
import sys
import uuid

import pytest

sys.path.insert(0, os.path.dirname(__file__))

import services  # noqa: E402


@pytest.fixture(scope="session")
def redis_url() -> str:
    try:
        return services.redis_url()
    except services.ServiceUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)


@pytest.fixture
def redis_prefix() -> str:
    """A key prefix of the test's own, so parallel suites do not collide."""
    return "ccbtest:" + uuid.uuid4().hex[:10] + ":"


def _db(kind: str, tmp_path):
    if kind == "sqlite":
        yield f"sqlite:///{tmp_path}/claims.sqlite3"
        return
    try:
        cm = services.fresh_database(kind)
        url = cm.__enter__()
    except services.ServiceUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)
    try:
        yield url
    finally:
        cm.__exit__(None, None, None)


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
