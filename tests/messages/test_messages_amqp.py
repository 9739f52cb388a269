"""Prebuilt task messages on RabbitMQ: what beat publishes is what Celery's own ``apply_async``
publishes for the same call, as it reaches a real RabbitMQ broker.

test_messages.py proves this on Redis, where a message is kombu's JSON envelope. On AMQP
the message is a content header plus body bytes, published to an exchange with a
routing key, and the broker can do things with it (priorities, per-message TTL,
confirms, quorum queues rerouting an eta). Each case here runs test_messages.py's
:func:`both_ways` (one occurrence through the :class:`Publisher`, then the same call
through Celery, checking which path the publisher took) and reads both messages off the
queue with py-amqp (:mod:`amqp_capture`): body bytes, every property and application
header in wire order with its type, the serialised content header, exchange and routing
key must be equal.
"""
from __future__ import annotations

import importlib.util
import json
import uuid
from datetime import datetime, timedelta, timezone

import amqp
import pytest
from celery import Celery
from kombu import Connection, Exchange, Queue
from kombu.exceptions import OperationalError

import services
from amqp_capture import Capture
from celery_cluster_beat.beat.publisher import Dispatch, Publisher
from celery_cluster_beat.schedules.occurrence import Occurrence
from test_messages import (AT, CASES, FROZEN, TASK, both_ways, case_dispatch, occurrence,  # noqa: F401
                           recorder)

#: Celery 5.5+ reroutes an eta on quorum queues through kombu's native delayed delivery.
NATIVE_DELAYED = importlib.util.find_spec("celery.utils.quorum_queues") is not None


def drain(capture: Capture, queue: str) -> list:
    """both_ways' reader for RabbitMQ: the envelopes on *queue* (taken off it)."""
    return capture.drain(queue)


@pytest.fixture(scope="module")
def module_vhost(rabbitmq_url):
    """One vhost for this module's tests (each uses queues of its own); deleted at the end."""
    try:
        cm = services.fresh_vhost(rabbitmq_url)
        url = cm.__enter__()
    except services.ServiceUnavailable as exc:
        pytest.fail(str(exc), pytrace=False)
    yield url
    cm.__exit__(None, None, None)


@pytest.fixture
def queue():
    return "ccbtest-msgs-" + uuid.uuid4().hex[:8]


@pytest.fixture
def opened():
    """Apps and captures made by the test, closed at its end (their broker connections)."""
    made = []
    yield made
    for thing in reversed(made):
        thing.close()


@pytest.fixture
def capture(module_vhost, opened):
    c = Capture(module_vhost)
    opened.append(c)
    return c


def amqp_app(url: str, queue: str, opened: list, **conf) -> Celery:
    app = Celery("msgs", broker=url, set_as_current=False)
    app.conf.task_default_queue = queue
    app.conf.update(conf)
    opened.append(app)
    return app


def assert_same(ours, celery_sent) -> None:
    assert ours == celery_sent, "our message differs from Celery's:\n" + ours.diff(celery_sent)


@pytest.mark.parametrize("case", CASES)
def test_a_stamped_message_on_rabbitmq_is_what_apply_async_publishes(module_vhost, queue, capture, opened, TASK,
                                                                      recorder, case):
    app = amqp_app(module_vhost, queue, opened)
    d, target = case_dispatch(app, queue, TASK, case)
    ours, celery_sent, our_calls, celery_calls = both_ways(app, capture, target, d, recorder, drain=drain)
    assert_same(ours, celery_sent)
    assert our_calls == celery_calls and [c[0] for c in our_calls] == ["before", "after"]
    # What was compared is the real thing: the task's message, routed to the queue by its name.
    h = ours.headers
    assert (h["task"], h["id"], h["cluster_beat_schedule"]) == (TASK, d.occurrence.task_id, "nightly")
    assert (ours.exchange, ours.routing_key) == ("", target)
    assert ours.raw["correlation_id"] == d.occurrence.task_id and ours.raw["delivery_mode"] == 2
    if case == "max-run-time-header":
        assert repr(h["cluster_beat_max_run_time"]) == "90.0"  # a float on the wire, as Celery sends it
    if case == "catchup-attempt":
        assert (h["cluster_beat_catchup"], h["cluster_beat_attempt"]) == (True, 3)
    if case == "compression":
        assert h["compression"] == "application/x-gzip"


def test_relative_expires_sets_the_same_rabbitmq_ttl_and_header_as_celery(module_vhost, queue, capture, opened, TASK,
                                                                           monkeypatch):
    """A relative ``expires`` becomes the AMQP ``expiration`` property (RabbitMQ drops the message
    after it) and the ``expires`` header, both from the send time (a frozen clock here)."""
    app = amqp_app(module_vhost, queue, opened)
    monkeypatch.setattr(app, "now", lambda: FROZEN)

    @app.task(name=TASK)
    def report(*args):
        return None

    d = Dispatch(occurrence(), TASK, (1,), {}, {"expires": 45})
    ours, celery_sent, _, _ = both_ways(app, capture, queue, d, drain=drain)
    assert_same(ours, celery_sent)
    assert ours.headers["expires"] == (FROZEN + timedelta(seconds=45)).isoformat()
    assert ours.raw["expiration"] == "45000"


def test_a_jittered_eta_is_stamped_per_occurrence_on_rabbitmq(module_vhost, queue, capture, opened, TASK):
    app = amqp_app(module_vhost, queue, opened)

    @app.task(name=TASK)
    def report(*args):
        return None

    publisher = Publisher(app, "node-a")
    for minute in (0, 1):
        occ = Occurrence("nightly", AT + timedelta(minutes=minute))
        eta = occ.at + timedelta(seconds=7 + minute)
        d = Dispatch(occ, TASK, (1,), {}, {}, eta=eta)
        ours, celery_sent, _, _ = both_ways(app, capture, queue, d, publisher=publisher, drain=drain)
        assert_same(ours, celery_sent)
        assert ours.headers["eta"] == eta.isoformat()
    assert len(publisher.templates) == 1  # the second occurrence was stamped from the first one's template


def test_a_priority_queue_gets_celerys_priority_and_rabbitmq_orders_by_it(module_vhost, queue, capture, opened, TASK):
    """An ``x-max-priority`` queue declared from ``task_queues`` and a ``priority`` option: the
    same declaration and property as Celery's, and the broker serves the higher one first."""
    app = amqp_app(module_vhost, queue, opened,
                   task_queues=[Queue(queue, Exchange(queue), routing_key=queue,
                                      queue_arguments={"x-max-priority": 10})])

    @app.task(name=TASK)
    def report(*args):
        return None

    d = Dispatch(occurrence(), TASK, (1,), {}, {"priority": 7})
    ours, celery_sent, _, _ = both_ways(app, capture, queue, d, drain=drain)
    assert_same(ours, celery_sent)
    assert ours.raw["priority"] == 7 and ours.headers["id"] == d.occurrence.task_id

    publisher = Publisher(app, "node-a")
    low = Dispatch(Occurrence("low", AT), TASK, (1,), {}, {"priority": 1})
    high = Dispatch(Occurrence("high", AT), TASK, (2,), {}, {"priority": 9})
    assert publisher.publish([low, high]) == [None, None]
    assert publisher.stamped == 2
    capture.wait_count(queue, 2)  # both in the queue: the broker orders what it holds
    got = capture.drain(queue, expect=2)
    assert [(e.headers["cluster_beat_schedule"], e.raw["priority"]) for e in got] == [("high", 9), ("low", 1)]


def test_publisher_confirms_same_message_and_a_nack_is_reported_not_lost(module_vhost, queue, capture, opened, TASK):
    """``confirm_publish``: each publish waits for the broker's ack; our message is Celery's, and
    a message the broker refuses (a full ``reject-publish`` queue) is an error of that send,
    as Celery's ``apply_async`` raises it, instead of being lost silently."""
    full = queue + "-full"
    app = amqp_app(module_vhost, queue, opened, broker_transport_options={"confirm_publish": True},
                   task_queues=[Queue(queue, Exchange(queue), routing_key=queue),
                                Queue(full, Exchange(full), routing_key=full,
                                      queue_arguments={"x-max-length": 0, "x-overflow": "reject-publish"})])

    @app.task(name=TASK)
    def report(*args, **kwargs):
        return None

    d = Dispatch(occurrence(), TASK, (1,), {"k": "v"}, {})
    ours, celery_sent, _, _ = both_ways(app, capture, queue, d, drain=drain)
    assert_same(ours, celery_sent)
    with app.producer_or_acquire() as producer:
        assert producer.channel._confirm_selected, "the channel was not in confirm mode"

    publisher = Publisher(app, "node-a")
    refused = Dispatch(Occurrence("refused", AT), TASK, (1,), {}, {"queue": full})
    [error] = publisher.publish([refused])
    # kombu raises the broker's nack as its OperationalError, from py-amqp's MessageNacked: so does Celery's.
    assert isinstance(error, OperationalError) and isinstance(error.__cause__, amqp.exceptions.MessageNacked), error
    with pytest.raises(OperationalError) as raised:
        report.apply_async((1,), queue=full)
    assert isinstance(raised.value.__cause__, amqp.exceptions.MessageNacked)
    assert capture.drain(full, expect=0) == []


# ----------------------------------------------------------------------------- quorum queues


def _quorum_setup(url: str, queue: str, opened: list, exchange_type: str):
    """An app whose queue is a quorum queue, and (5.5+) the delayed-delivery topology a worker
    declares at start (``celery_delayed_0..27`` and the delivery exchange, bound to the queue)."""
    ex = Exchange(queue, type=exchange_type)
    q = Queue(queue, ex, routing_key=queue, queue_arguments={"x-queue-type": "quorum"})
    app = amqp_app(url, queue, opened, task_queues=[q], task_default_exchange=queue,
                   task_default_exchange_type=exchange_type)
    if NATIVE_DELAYED:
        from kombu.transport.native_delayed_delivery import (bind_queue_to_native_delayed_delivery_exchange,
                                                             declare_native_delayed_delivery_exchanges_and_queues)

        with Connection(url) as conn:
            q.bind(conn.default_channel).declare()
            declare_native_delayed_delivery_exchanges_and_queues(conn, "quorum")
            if exchange_type != "direct":
                bind_queue_to_native_delayed_delivery_exchange(conn, q)
    return app


@pytest.mark.timeout(180)
@pytest.mark.parametrize("exchange_type", ["topic", "direct"])
def test_an_eta_on_a_quorum_queue_goes_where_celery_sends_it(rabbitmq_vhost, opened, TASK, monkeypatch,
                                                              exchange_type):
    """Celery 5.5+ sends an eta on quorum queues as a countdown through the ``celery_delayed_*``
    exchanges (a topic exchange; on a direct one it warns and does not). The messages module
    does not stamp an eta there (``eta_ok``): Celery's own path sends it, so exchange, routing
    key and envelope are Celery's in both cases; without an eta the template is used."""
    queue = "ccbtest-quorum-" + exchange_type
    capture = Capture(rabbitmq_vhost)
    opened.append(capture)
    app = _quorum_setup(rabbitmq_vhost, queue, opened, exchange_type)
    now = datetime.now(timezone.utc)
    monkeypatch.setattr(app, "now", lambda: now)  # one countdown for both sends

    @app.task(name=TASK)
    def report(*args, **kwargs):
        return None

    rerouted = NATIVE_DELAYED and exchange_type == "topic"
    # Celery publishes to a direct queue through the default exchange, to others through theirs.
    direct_exchange = "" if exchange_type == "direct" else queue
    watch = queue
    if rerouted:  # what is published to the first delay exchange, as published
        watch = queue + "-tap"
        capture.declare(watch, bind_to="celery_delayed_27")
    eta = now + timedelta(seconds=3)
    d = Dispatch(Occurrence("nightly", AT), TASK, (1,), {"x": 1}, {}, eta=eta)
    ours, celery_sent, _, _ = both_ways(app, capture, watch, d, template=not NATIVE_DELAYED, drain=drain)
    assert_same(ours, celery_sent)
    assert ours.headers["eta"] == eta.isoformat()
    if rerouted:
        from kombu.transport.native_delayed_delivery import calculate_routing_key

        assert (ours.exchange, ours.routing_key) == ("celery_delayed_27", calculate_routing_key(3, queue))
        # Both then reach the queue through the delay levels, after the countdown, still equal
        # but for what the broker adds on the way (x-death and friends).
        delivered = capture.drain(queue, expect=2, timeout=30)
        assert len(delivered) == 2, delivered
        stripped = [{**e.raw, "application_headers": {k: v for k, v in e.headers.items() if not k.startswith("x-")}}
                    for e in delivered]
        assert repr(stripped[0]) == repr(stripped[1]) and delivered[0].body == delivered[1].body
        assert [e.headers["id"] for e in delivered] == [d.occurrence.task_id] * 2
        assert {e.routing_key for e in delivered} == {calculate_routing_key(3, queue)}
    else:  # published as any message to the queue (the worker then holds it until its eta)
        assert (ours.exchange, ours.routing_key) == (direct_exchange, queue)

    # Without an eta nothing is rerouted: the template serves it.
    plain = Dispatch(Occurrence("nightly", AT + timedelta(minutes=1)), TASK, (1,), {"x": 1}, {})
    ours, celery_sent, _, _ = both_ways(app, capture, queue, plain, drain=drain)
    assert_same(ours, celery_sent)
    assert (ours.exchange, ours.routing_key) == (direct_exchange, queue)
    assert json.loads(ours.body)[1] == {"x": 1}
