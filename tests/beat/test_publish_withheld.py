"""The publisher withholds the rest of a chunk whose rows were taken over while it was held up.

In-process, against real brokers and a real claim store: node a claimed the rows
and publishes them; the publisher is held up (the package's ``mid-chunk`` fault
point, a sleep) after 20 messages, and meanwhile node b's sweep takes every row
over. When the publisher goes on, the chunk's confirmation is older than its
validity, so it confirms the rest again with the store and withholds what is no
longer a's. On RabbitMQ each message is out as soon as it is published: the 20
before the pause reached the broker, none after. On Redis the messages of a chunk
are buffered until one flush: the 20 buffered ones are dropped too, so nothing of
the chunk reaches the broker. (The real-process case, with a successor that
resends: test_pause_mid_chunk.py.)
"""
from __future__ import annotations

import threading
import time
import uuid
from datetime import datetime, timezone
from typing import List, Optional, Set, Tuple

import pytest
import redis
from celery import Celery
from kombu import Connection

from celery_cluster_beat import faults
from celery_cluster_beat.beat.publisher import Dispatch, Ownership, Publisher, Withheld
from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.store import ClaimStore

UTC = timezone.utc
T0 = datetime(2021, 1, 1, tzinfo=UTC)
N, BEFORE = 60, 20


@pytest.fixture
def held_up_after_20():
    """The ``mid-chunk`` fault point sleeps 5 s at its 20th hit (before the 21st message)."""
    saved = faults._points, faults._arm_dir, dict(faults._hits)
    faults._points, faults._arm_dir = faults._parse(f"mid-chunk=sleep:5@{BEFORE}"), None
    faults._hits.clear()
    yield
    faults._points, faults._arm_dir = saved[0], saved[1]
    faults._hits.clear()
    faults._hits.update(saved[2])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("broker", ["redis", "amqp"])
def test_rows_taken_over_while_the_publisher_was_held_up_are_withheld(broker, request, tmp_path,
                                                                      held_up_after_20):
    url = request.getfixturevalue("redis_url" if broker == "redis" else "rabbitmq_vhost")
    queue = "ccbtest-withheld-" + uuid.uuid4().hex[:8]
    app = Celery("withheld", broker=url, set_as_current=False)
    db = f"sqlite:///{tmp_path}/claims.sqlite3"
    a, b = ClaimStore(db, node_id="node-a"), ClaimStore(db, node_id="node-b")
    a.open()
    b.open()
    try:
        occs = [Occurrence(f"w{i:02d}", T0) for i in range(N)]
        assert a.claim(occs) == occs

        def confirm(pending: List[Occurrence]) -> Tuple[Set[Occurrence], float]:
            at = time.monotonic()
            return set(a.confirm(pending)), at

        ownership = Ownership(time.monotonic(), 1.0, confirm)
        publisher = Publisher(app, "node-a")
        dispatches = [Dispatch(o, "t.record", (i,), {}, {"queue": queue}) for i, o in enumerate(occs)]
        out: dict = {}
        thread = threading.Thread(target=lambda: out.setdefault("errors", publisher.publish(dispatches, ownership)))
        thread.start()
        deadline = time.monotonic() + 30
        while faults._hits.get("mid-chunk", 0) < BEFORE:  # the publisher sleeps at the fault point now
            assert thread.is_alive() and time.monotonic() < deadline, "the fault point was never reached"
            time.sleep(0.01)
        time.sleep(0.2)
        taken = b.take_over_stale(0.1)  # node a never heartbeated: it looks gone
        assert {(o.schedule, o.at) for o in taken} == {(o.schedule, o.at) for o in occs}
        thread.join(60)
        assert not thread.is_alive()
        errors: List[Optional[BaseException]] = out["errors"]

        if broker == "redis":
            client = redis.Redis.from_url(url)
            try:
                on_broker = client.llen(queue)
                client.delete(queue)
            finally:
                client.close()
        else:
            with Connection(url) as conn:
                simple = conn.SimpleQueue(queue)
                try:
                    on_broker = simple.qsize()
                finally:
                    simple.close()
        if broker == "amqp":  # out one by one: the 20 before the pause, not one after
            assert on_broker == BEFORE
            assert errors[:BEFORE] == [None] * BEFORE
            assert all(isinstance(e, Withheld) for e in errors[BEFORE:]), errors
        else:  # buffered, then dropped with the rest
            assert on_broker == 0
            assert all(isinstance(e, Withheld) for e in errors), errors
        assert ownership.error is None
        assert publisher.watch.problem is None  # withheld is not a failed send
    finally:
        a.close()
        b.close()
