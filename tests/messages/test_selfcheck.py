"""The fast path proves itself and never stops the sending (celery_cluster_beat.messages.selfcheck,
.celerysend, .templates): a Celery whose messages the templates do not reproduce, or whose
privates are not where the fast path reads them, gets its messages through its own path, with
one log line, on a real Redis broker."""
from __future__ import annotations

import itertools
import json
import logging
from datetime import timedelta

import pytest
from celery.app import amqp as celery_amqp

from celery_cluster_beat.messages import celerysend
from celery_cluster_beat.messages import Template
from celery_cluster_beat.beat.publisher import Dispatch, Publisher
from celery_cluster_beat.schedules.occurrence import Occurrence

from test_messages import AT, TASK, client, drain, queue, registered  # noqa: F401 (fixtures)


def dispatches(task: str, n: int, name: str = "nightly", **options):
    return [Dispatch(Occurrence(f"{name}-{i}", AT + timedelta(minutes=i)), task, (i,), {}, dict(options))
            for i in range(n)]


def warnings_of(caplog) -> list:
    return [r.getMessage() for r in caplog.records
            if r.name == "celery_cluster_beat.publisher" and r.levelno >= logging.WARNING]


def test_entries_of_one_shape_share_one_check_that_passes(redis_url, queue, client, TASK):
    app = registered(redis_url, queue, TASK)
    publisher = Publisher(app, "node-a")
    sends = dispatches(TASK, 30) + dispatches(TASK, 5, name="routed", queue=queue)
    assert publisher.publish(sends) == [None] * 35
    assert (publisher.stamped, publisher.celery_path) == (35, 0)
    # Two shapes (no options / a queue option), each checked once and found equal.
    assert list(publisher.templates.shapes.values()) == [None, None]
    assert len(drain(client, queue)) == 35


def test_a_celery_that_stamps_a_per_call_value_gets_its_own_path_with_one_warning(
        redis_url, queue, client, TASK, monkeypatch, caplog):
    """As if a future Celery wrote something per call that a template cannot know (here: the
    ``origin`` header changes per message): the check finds it before the first send."""
    counter = itertools.count()
    monkeypatch.setattr(celery_amqp, "anon_nodename", lambda *a, **kw: f"gen{next(counter)}@host")
    app = registered(redis_url, queue, TASK)
    publisher = Publisher(app, "node-a")
    caplog.set_level(logging.INFO, logger="celery_cluster_beat.publisher")
    sends = dispatches(TASK, 4)
    assert publisher.publish(sends) == [None] * 4
    assert (publisher.stamped, publisher.celery_path) == (0, 4)
    said = warnings_of(caplog)
    assert len(said) == 1, said
    assert "nightly-0" in said[0] and "header origin" in said[0]
    sent = [json.loads(raw)["headers"] for raw in drain(client, queue)]
    assert sorted(h["id"] for h in sent) == sorted(d.occurrence.task_id for d in sends)
    assert len({h["origin"] for h in sent}) == 4  # Celery's own per-call values went out


def test_a_private_the_fast_path_reads_renamed_turns_the_fast_path_off_not_the_sending(
        redis_url, queue, client, TASK, monkeypatch, caplog):
    monkeypatch.setitem(celerysend.PRIVATES, "callback_publish_retry",
                        ("celery.app.amqp", "_callback_publish_retry_renamed_in_a_later_celery", (0,)))
    app = registered(redis_url, queue, TASK)
    publisher = Publisher(app, "node-a")
    caplog.set_level(logging.INFO, logger="celery_cluster_beat.publisher")
    sends = dispatches(TASK, 3)
    assert publisher.publish(sends) == [None] * 3
    assert (publisher.stamped, publisher.celery_path) == (0, 3)
    said = warnings_of(caplog)
    assert len(said) == 1 and "_callback_publish_retry_renamed_in_a_later_celery" in said[0], said
    assert sorted(json.loads(r)["headers"]["id"] for r in drain(client, queue)) == \
        sorted(d.occurrence.task_id for d in sends)


def test_a_template_that_breaks_while_stamping_hands_the_message_to_celery(
        redis_url, queue, client, TASK, monkeypatch, caplog):
    app = registered(redis_url, queue, TASK)
    publisher = Publisher(app, "node-a")
    first, *rest = dispatches(TASK, 3, name="same")
    assert publisher.publish([first]) == [None] and publisher.stamped == 1

    def broken(self, *args, **kwargs):
        raise KeyError("a field a later Celery renamed")

    monkeypatch.setattr(Template, "stamp", broken)
    caplog.set_level(logging.INFO, logger="celery_cluster_beat.publisher")
    again = [Dispatch(Occurrence("same-0", AT + timedelta(hours=h)), TASK, (0,), {}, first.options)
             for h in (1, 2)]
    again[1].options = again[0].options = first.options
    again[0].args = again[1].args = first.args
    assert publisher.publish(again) == [None, None]
    assert (publisher.stamped, publisher.celery_path) == (1, 2)
    said = warnings_of(caplog)
    assert len(said) == 1 and "same-0" in said[0] and "replaying its prebuilt message failed" in said[0], said
    assert len(drain(client, queue)) == 3


def test_a_node_whose_every_send_fails_says_so_once_a_minute_and_health_fails(
        redis_url, queue, TASK, caplog):
    """Nothing is silent: a broker that cannot be reached makes every send fail the same way."""
    app = registered("redis://127.0.0.1:1/0", queue, TASK, broker_connection_retry=False,
                     broker_connection_max_retries=0, broker_transport_options={"max_retries": 0},
                     task_publish_retry=False)
    publisher = Publisher(app, "node-a")
    caplog.set_level(logging.ERROR, logger="celery_cluster_beat")
    for i in range(5):
        errors = publisher.publish(dispatches(TASK, 1, name=f"e{i}"))
        assert errors[0] is not None
    assert publisher.watch.problem is not None and "the last 5 sends all failed" in publisher.watch.problem
    said = [r.getMessage() for r in caplog.records if "sends nothing" in r.getMessage()]
    assert len(said) == 1, said  # once a minute, not once a send


def test_health_reports_the_send_problem():
    from celery_cluster_beat.ops.http import LoopHealth

    health = LoopHealth(margin=5)
    health.ticked(1.0)
    assert health.check()[0]
    health.problem = "the last 3 sends all failed with OperationalError: refused"
    ok, text = health.check()
    assert not ok and text.startswith("failing: the last 3 sends")
