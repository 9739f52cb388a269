"""Fixtures of the in-process beat tests: a real ``Scheduler`` in the test's process against a
real Redis broker and real claim databases (modules that need another shape define their own)."""
from __future__ import annotations

from typing import List
from urllib.parse import urlsplit, urlunsplit

import pytest
import redis
from celery import Celery

#: A Redis database of these tests' own; every app also has its own queue.
BROKER_DB = 7


@pytest.fixture
def broker(redis_url) -> str:
    return urlunsplit(urlsplit(redis_url)._replace(path=f"/{BROKER_DB}"))


@pytest.fixture(params=["sqlite", "postgresql"])
def db(request, tmp_path):
    """The claim database: a SQLite file of the test's own, or a PostgreSQL database of its own."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path}/claims.sqlite3"
        return
    yield request.getfixturevalue("pg_url")


@pytest.fixture
def made():
    """What the test makes (apps, schedulers, stores); closed afterwards, newest first, and each
    app's queue deleted."""
    things: List = []
    yield things
    for thing in reversed(things):
        if isinstance(thing, Celery):
            client = redis.Redis.from_url(thing.conf.broker_url)
            client.delete(thing.conf.task_default_queue)
            client.close()
            thing.close()
        else:
            thing.close()
