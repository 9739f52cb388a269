"""The message fast path at its edges (celery_cluster_beat.messages): found by an adversarial
review, one test each.

What beat publishes equals apply_async's, user receivers never fire for a message that is not
sent and fire once for one that is, nothing runs or is published by a capture / self-check /
dry run, and an incompatibility turns the fast path off and never the sending: a Celery without
the deprecated task_sent signal, eager mode under ``check``, receivers and wrappers set on other
threads or on instances, nested header edits, a per-call shadow name, kombu refusing a replay.

Real Redis broker, as in test_messages.py. Two tests (the receiver-swap races) make the
interleaving deterministic by pausing the template build at the moment it publishes into
its recording producer (a wrapper around ``RecordingProducer.publish`` that waits for the
other thread); the race itself needs nothing but another thread publishing or connecting
a receiver while a template is built or checked.
"""
from __future__ import annotations

import functools
import itertools
import json
import threading
from datetime import timedelta

import pytest
from celery import signals

from celery_cluster_beat.beat.publisher import Dispatch, Publisher
from celery_cluster_beat.messages import Templates, celerysend
from celery_cluster_beat.messages.dryrun import SendPath, dry_run
from celery_cluster_beat.schedules.occurrence import Occurrence

from test_messages import (AT, TASK, both_ways, client, drain, make_app, queue, registered,  # noqa: F401
                           without_tag)


@pytest.fixture
def receivers():
    """Connect receivers for the test; all are disconnected at the end whatever happens."""
    connected = []

    def connect(signal, func):
        signal.connect(func, weak=False)
        connected.append((signal, func))

    yield connect
    for signal, func in connected:
        signal.disconnect(func)


def pause_recording_until(monkeypatch, other):
    """While the main thread's template build is inside the receivers swap (publishing into its
    recording producer), run *other* on a second thread and wait for it to finish."""
    go, done = threading.Event(), threading.Event()
    errors = []
    original = celerysend.RecordingProducer.publish

    def paused(self, body, **kwargs):
        if threading.current_thread() is threading.main_thread() and not go.is_set():
            go.set()
            assert done.wait(20), "the other thread did not finish"
        return original(self, body, **kwargs)

    def run():
        if not go.wait(20):
            errors.append("the template build never reached its recording producer")
        else:
            try:
                other()
            except Exception as exc:  # reported by the test, not lost in the thread
                errors.append(repr(exc))
        done.set()

    monkeypatch.setattr(celerysend.RecordingProducer, "publish", paused)
    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, errors


# --------------------------------------------------------------------------- 1. sending stops


def test_a_celery_without_the_deprecated_task_sent_signal_still_sends(redis_url, queue, client, TASK, monkeypatch):
    import celery.signals

    app = registered(redis_url, queue, TASK)
    app.amqp.send_task_message  # Celery's sender built (a Celery without task_sent would not read it)
    monkeypatch.delattr(celery.signals, "task_sent")
    # Celery's own path does not need it: the control send goes out.
    app.tasks[TASK].apply_async((0,))
    assert len(drain(client, queue)) == 1
    publisher = Publisher(app, "node-a")
    errors = publisher.publish([Dispatch(Occurrence("nightly", AT), TASK, (1,), {}, {})])
    assert errors == [None]  # today: [AttributeError("module 'celery.signals' has no attribute 'task_sent'")]
    assert len(drain(client, queue)) == 1


def test_an_entry_celery_can_send_is_sent_whatever_the_fast_path_makes_of_it(redis_url, queue, client, TASK):
    app = registered(redis_url, queue, TASK)
    app.tasks[TASK].apply_async((0,), headers={1: "legacy"})  # Celery sends it (JSON turns the key into "1")
    assert [json.loads(r)["headers"]["1"] for r in drain(client, queue)] == ["legacy"]
    publisher = Publisher(app, "node-a")
    errors = publisher.publish([Dispatch(Occurrence("nightly", AT), TASK, (1,), {}, {"headers": {1: "legacy"}})])
    assert errors == [None]  # today: [TypeError("'<' not supported between instances of 'str' and 'int'")]


# --------------------------------------------------------------------------- 2. dry run side effects


def test_check_never_runs_a_task_when_task_always_eager_is_set(redis_url, queue, TASK):
    app = make_app(redis_url, queue, task_always_eager=True)
    ran = []

    @app.task(name=TASK)
    def bill(customer):
        ran.append(customer)

    result = dry_run(app, Templates(app), "billing", TASK, ("acme",), {}, {}, {"cluster_beat_schedule": "billing"})
    assert ran == []  # today: ['acme'], the task ran
    assert result.path is not SendPath.UNSENDABLE


def test_check_fires_no_task_sent_receiver(redis_url, queue, TASK, receivers):
    app = registered(redis_url, queue, TASK)
    fired = []
    receivers(signals.task_sent, lambda sender=None, **kw: fired.append(sender))
    result = dry_run(app, Templates(app), "nightly", TASK, (1,), {}, {}, {})
    assert result.path is SendPath.CELERY
    assert fired == []  # today: [TASK]


# --------------------------------------------------------------------------- 3. receivers swap races


def test_a_message_sent_on_another_thread_during_a_build_reaches_its_receivers(
        redis_url, queue, client, TASK, monkeypatch, receivers):
    app = make_app(redis_url, queue)
    other_queue = queue + "-web"

    @app.task(name=TASK)
    def report(*args):
        return None

    @app.task(name=TASK + ".web")
    def web(*args):
        return None

    traced = []

    def tracer(sender=None, headers=None, **kw):
        traced.append(sender)
        headers["traceparent"] = "00-trace-01"

    receivers(signals.before_task_publish, tracer)
    publisher = Publisher(app, "node-a")
    args, kwargs, options = (1,), {}, {}
    # One entry of the shape first: its check passes, later entries of the shape are not checked.
    assert publisher.prepare(Dispatch(Occurrence("first", AT), TASK, args, kwargs, options))
    thread, errors = pause_recording_until(monkeypatch, lambda: web.apply_async((42,), queue=other_queue))
    second = Dispatch(Occurrence("second", AT), TASK, args, kwargs, options)
    assert publisher.prepare(second)
    thread.join(20)
    monkeypatch.undo()
    assert not errors, errors
    web_sent = [json.loads(r)["headers"] for r in drain(client, other_queue)]
    assert len(web_sent) == 1
    template_sender = publisher.templates._by_name["second"].before["sender"]
    traced.clear()
    ours, celery_sent, _, _ = both_ways(app, client, queue, second, publisher=publisher)
    # Today: the web message went out without its trace header (tracer never ran for it), the
    # template recorded sender=<TASK>.web, and "second"'s messages lack the trace header.
    assert web_sent[0].get("traceparent") == "00-trace-01"
    assert template_sender == TASK
    assert without_tag(ours) == without_tag(celery_sent)
    assert traced == [TASK, TASK]


def test_a_receiver_connected_during_a_build_stays_connected(redis_url, queue, TASK, monkeypatch):
    app = registered(redis_url, queue, TASK)

    def late(sender=None, **kw):
        return None

    thread, errors = pause_recording_until(
        monkeypatch, lambda: signals.before_task_publish.connect(late, weak=False))
    try:
        Publisher(app, "node-a").prepare(Dispatch(Occurrence("nightly", AT), TASK, (1,), {}, {}))
        thread.join(20)
        assert not errors, errors
        assert any(entry[1] is late for entry in signals.before_task_publish.receivers)  # today: gone
    finally:
        signals.before_task_publish.disconnect(late)


# --------------------------------------------------------------------------- 4. template != Celery, unnoticed


def test_a_receiver_editing_a_nested_header_edits_its_own_message_only(redis_url, queue, client, TASK, receivers):
    app = registered(redis_url, queue, TASK)

    def limit_catchups(sender=None, headers=None, **kw):
        if headers.get("cluster_beat_catchup"):
            headers["timelimit"][1] = 30  # catch-up runs get a 30 s soft limit

    receivers(signals.before_task_publish, limit_catchups)
    publisher = Publisher(app, "node-a")
    args, kwargs, options = (1,), {}, {}
    first = Dispatch(Occurrence("nightly", AT), TASK, args, kwargs, options, catchup=True)
    assert publisher.publish([first]) == [None]
    assert [json.loads(r)["headers"]["timelimit"] for r in drain(client, queue)] == [[None, 30]]
    second = Dispatch(Occurrence("nightly", AT + timedelta(minutes=1)), TASK, args, kwargs, options)
    ours, celery_sent, _, _ = both_ways(app, client, queue, second, publisher=publisher)
    assert json.loads(celery_sent)["headers"]["timelimit"] == [None, None]
    assert json.loads(ours)["headers"]["timelimit"] == [None, None]  # today: [None, 30]
    assert without_tag(ours) == without_tag(celery_sent)


def test_a_per_call_shadow_name_is_asked_per_message(redis_url, queue, client, TASK):
    app = make_app(redis_url, queue)

    @app.task(name=TASK + ".plain")
    def plain(*args):
        return None

    day = itertools.count(1)

    def shadow_name(self, args, kwargs, options):
        return f"report for day {next(day)}"  # as f"report {date.today()}" would

    @app.task(name=TASK, shadow_name=shadow_name)
    def report(*args):
        return None

    publisher = Publisher(app, "node-a")
    assert publisher.publish([Dispatch(Occurrence("plain", AT), TASK + ".plain", (1,), {}, {})]) == [None]
    args, kwargs, options = (2,), {}, {}
    assert publisher.publish([Dispatch(Occurrence("report", AT), TASK, args, kwargs, options)]) == [None]
    drain(client, queue)
    later = Dispatch(Occurrence("report", AT + timedelta(days=1)), TASK, args, kwargs, options)
    ours, celery_sent, _, _ = both_ways(app, client, queue, later, publisher=publisher, template=False)
    # A shadow_name of the task's own is asked per message: its entries take Celery's path.
    # Asked per message, ours first, then Celery's reference send (day 1 was the first publish).
    assert [json.loads(m)["headers"]["shadow"] for m in (ours, celery_sent)] == [
        "report for day 2", "report for day 3"]


def test_a_send_task_message_wrapper_installed_later_sees_every_message(redis_url, queue, client, TASK):
    app = registered(redis_url, queue, TASK)
    assert Publisher(app, "node-a").publish([Dispatch(Occurrence("early", AT), TASK, (0,), {}, {})]) == [None]
    drain(client, queue)
    seen = []
    inner = app.amqp.send_task_message

    @functools.wraps(inner)
    def instrumented(producer, name, message, **options):
        seen.append(message.headers["id"])
        return inner(producer, name, message, **options)

    app.amqp.send_task_message = instrumented  # e.g. an instrumentation library set up lazily
    publisher = Publisher(app, "node-a")
    args, kwargs, options = (1,), {}, {}
    sends = [Dispatch(Occurrence("nightly", AT + timedelta(minutes=m)), TASK, args, kwargs, options)
             for m in range(3)]
    assert publisher.publish(sends) == [None] * 3
    assert len(drain(client, queue)) == 3
    # Today: seen holds the template's placeholder id and the self-check's id (twice), none of these.
    assert seen == [d.occurrence.task_id for d in sends]


def test_a_send_task_wrapped_on_the_app_instance_sees_every_message(redis_url, queue, client, TASK):
    app = registered(redis_url, queue, TASK)
    seen = []
    original = app.send_task

    def audited(name, args=None, kwargs=None, **options):
        seen.append(options.get("task_id"))
        return original(name, args, kwargs, **options)

    app.send_task = audited
    publisher = Publisher(app, "node-a")
    args, kwargs, options = (1,), {}, {}
    sends = [Dispatch(Occurrence("nightly", AT + timedelta(minutes=m)), TASK, args, kwargs, options)
             for m in range(3)]
    assert publisher.publish(sends) == [None] * 3
    assert len(drain(client, queue)) == 3
    assert seen == [d.occurrence.task_id for d in sends]


def test_a_refused_replay_fires_each_receiver_once(redis_url, queue, client, TASK, receivers):
    app = registered(redis_url, queue, TASK)
    calls = []
    receivers(signals.before_task_publish, lambda sender=None, headers=None, **kw: calls.append(headers["id"]))
    publisher = Publisher(app, "node-a")
    args, kwargs, options = (1,), {}, {}
    first = Dispatch(Occurrence("nightly", AT), TASK, args, kwargs, options)
    assert publisher.prepare(first)
    calls.clear()
    # As if this kombu refused an argument the replay passes (what the TemplateBroken fallback is for):
    publisher.templates._by_name["nightly"].publish["compression"] = "no-such-codec"
    assert publisher.publish([first]) == [None]
    assert (publisher.stamped, publisher.celery_path) == (0, 1)
    assert len(drain(client, queue)) == 1
    assert calls == [first.occurrence.task_id]  # today: the same id twice
