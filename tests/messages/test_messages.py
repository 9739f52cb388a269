"""Prebuilt task messages (celery_cluster_beat.messages): what beat puts on the broker is
byte for byte what Celery's own ``apply_async`` / ``send_task`` puts there for the same call, and
``before_task_publish`` / ``after_task_publish`` fire with the same arguments.

Each case sends one occurrence through the :class:`Publisher` (from a template built once
and stamped), then the same call through Celery, both to a real Redis broker; the two raw
envelopes on the queue must be the same string once kombu's random ``delivery_tag`` is set
aside. Every case also checks which path the publisher took, so a template silently not
used (the comparison would then be Celery against itself) fails the test.
"""
from __future__ import annotations

import copy
import json
import uuid
from datetime import datetime, timedelta, timezone

import pytest
import redis
from celery import Celery, signals

from celery_cluster_beat.beat.publisher import Dispatch, Publisher
from celery_cluster_beat.schedules.occurrence import Occurrence

AT = datetime(2030, 5, 17, 8, 30, tzinfo=timezone.utc)
FROZEN = datetime(2030, 5, 17, 8, 30, 0, 250000, tzinfo=timezone.utc)


def make_app(redis_url: str, queue: str, **conf) -> Celery:
    app = Celery("msgs", broker=redis_url, set_as_current=False)
    app.conf.task_default_queue = queue
    app.conf.update(conf)
    return app


def registered(redis_url: str, queue: str, task: str, **conf) -> Celery:
    """An app with one task registered under *task* that takes any positional arguments."""
    app = make_app(redis_url, queue, **conf)

    @app.task(name=task)
    def report(*args):
        return None

    return app


def drain(client: redis.Redis, queue: str) -> list:
    """Every message on *queue*, its priority lists included (kombu keeps one list per priority)."""
    raw = []
    for key in sorted(client.scan_iter(match=queue + "*")):
        if client.type(key) == b"list":
            raw += client.lrange(key, 0, -1)
            client.delete(key)
    return [r.decode() for r in raw]


def without_tag(raw: str) -> str:
    """The envelope with kombu's random delivery tag replaced (everything else compared as sent)."""
    tag = json.loads(raw)["properties"]["delivery_tag"]
    return raw.replace(tag, "<tag>")


class Recorder:
    """Arguments of every before/after_task_publish call (headers copied: receivers may mutate)."""

    def __init__(self):
        self.calls = []

    def before(self, sender=None, body=None, exchange=None, routing_key=None, headers=None, properties=None,
               declare=None, retry_policy=None, **kw):
        self.calls.append(("before", sender, json.dumps(body, default=str), exchange, routing_key,
                           json.dumps(headers, default=str), json.dumps(properties, default=str),
                           [getattr(q, "name", q) for q in declare or []], json.dumps(retry_policy, default=str)))

    def after(self, sender=None, body=None, exchange=None, routing_key=None, headers=None, **kw):
        self.calls.append(("after", sender, json.dumps(body, default=str), exchange, routing_key,
                           json.dumps(headers, default=str)))


@pytest.fixture
def recorder():
    rec = Recorder()
    signals.before_task_publish.connect(rec.before, weak=False)
    signals.after_task_publish.connect(rec.after, weak=False)
    yield rec
    signals.before_task_publish.disconnect(rec.before)
    signals.after_task_publish.disconnect(rec.after)


def both_ways(app: Celery, client, queue: str, dispatch: Dispatch, recorder=None, *, template: bool = True,
              publisher: Publisher = None, drain=drain):
    """Send *dispatch* through the publisher, then the same call through Celery; return both
    raw envelopes (and both signal records). *drain(client, queue)* reads them off the broker
    (Redis lists here; test_messages_amqp.py passes its RabbitMQ reader)."""
    # Pristine copies for Celery's reference send: a receiver that edits the body edits the
    # objects it is given, ours included.
    args, kwargs = copy.deepcopy(dispatch.args), copy.deepcopy(dispatch.kwargs)
    publisher = publisher or Publisher(app, "node-a")
    before = (publisher.stamped, publisher.celery_path)
    errors = publisher.publish([dispatch])
    assert errors == [None], errors
    assert (publisher.stamped - before[0], publisher.celery_path - before[1]) == ((1, 0) if template else (0, 1))
    ours = drain(client, queue)
    ours_calls = list(recorder.calls) if recorder else None
    if recorder:
        recorder.calls.clear()
    headers = dict(dispatch.options.get("headers") or {})
    headers.update({
        "cluster_beat_schedule": dispatch.occurrence.schedule,
        "cluster_beat_scheduled_at": dispatch.occurrence.at.isoformat().replace("+00:00", "Z"),
        "cluster_beat_node": "node-a",
        "cluster_beat_catchup": dispatch.catchup,
        "cluster_beat_attempt": dispatch.attempt,
        "celery_beat_task": True,
    })
    if dispatch.max_run_time is not None:
        headers["cluster_beat_max_run_time"] = dispatch.max_run_time
    options = {k: v for k, v in dispatch.options.items() if k != "headers"}
    if dispatch.eta is not None:
        options["eta"] = dispatch.eta
    task = app.tasks.get(dispatch.task)
    with app.producer_or_acquire() as producer:
        if task is not None:
            task.apply_async(args, kwargs, task_id=dispatch.occurrence.task_id, producer=producer,
                             headers=headers, **options)
        else:
            app.send_task(dispatch.task, args, kwargs, task_id=dispatch.occurrence.task_id,
                          producer=producer, headers=headers, **options)
    celery_sent = drain(client, queue)
    assert len(ours) == 1 and len(celery_sent) == 1, (ours, celery_sent)
    return ours[0], celery_sent[0], ours_calls, (recorder.calls if recorder else None)


@pytest.fixture
def TASK():
    """A task name of the test's own: Celery keeps the first callable registered under a name
    for the whole process."""
    return "msgs.report." + uuid.uuid4().hex[:8]


@pytest.fixture
def queue():
    return "ccbtest-msgs-" + uuid.uuid4().hex[:8]


@pytest.fixture
def client(redis_url):
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


def occurrence(name: str = "nightly") -> Occurrence:
    return Occurrence(name, AT)


#: The shapes of entry every broker's equality test sends both ways.
CASES = ["plain", "kwargs-and-headers", "exec-options", "routed-queue", "ignore-result", "compression",
         "max-run-time-header", "catchup-attempt"]


def case_dispatch(app: Celery, queue: str, task: str, case: str):
    """Register *case*'s task on *app* (and its route); the dispatch and the queue it lands on."""
    other = queue + "-routed"
    if case == "routed-queue":
        app.conf.task_routes = {task: {"queue": other}}

    @app.task(name=task, time_limit=300 if case == "exec-options" else None,
              soft_time_limit=200 if case == "exec-options" else None,
              ignore_result=case == "ignore-result", priority=3 if case == "exec-options" else None)
    def report(*args, **kwargs):
        return None

    options, kwargs = {}, {}
    if case == "kwargs-and-headers":
        kwargs = {"region": "eu", "limit": 10, "tags": ["a", "b"], "ratio": 0.5, "none": None}
        options = {"headers": {"tenant": "acme", "flag": True, "n": 7}, "priority": 5}
    if case == "compression":
        options = {"compression": "zlib"}
    d = Dispatch(occurrence(), task, (1, "two"), kwargs, options,
                 max_run_time=90.0 if case == "max-run-time-header" else None,
                 catchup=case == "catchup-attempt", attempt=3 if case == "catchup-attempt" else 1)
    return d, other if case == "routed-queue" else queue


@pytest.mark.parametrize("case", CASES)
def test_a_stamped_message_is_byte_for_byte_what_apply_async_sends(redis_url, queue, client, TASK, recorder, case):
    app = make_app(redis_url, queue)
    d, target = case_dispatch(app, queue, TASK, case)
    ours, celery_sent, our_calls, celery_calls = both_ways(app, client, target, d, recorder)
    assert without_tag(ours) == without_tag(celery_sent)
    assert our_calls == celery_calls and [c[0] for c in our_calls] == ["before", "after"]


def test_relative_expires_is_computed_from_the_send_time_as_celery_does(redis_url, queue, client, TASK, monkeypatch):
    app = make_app(redis_url, queue)
    monkeypatch.setattr(app, "now", lambda: FROZEN)

    @app.task(name=TASK)
    def report(*args):
        return None

    d = Dispatch(occurrence(), TASK, (1,), {}, {"expires": 45})
    ours, celery_sent, _, _ = both_ways(app, client, queue, d)
    assert without_tag(ours) == without_tag(celery_sent)
    sent = json.loads(ours)
    assert sent["headers"]["expires"] == (FROZEN + timedelta(seconds=45)).isoformat()
    assert sent["properties"]["expiration"] == "45000"


def test_a_jittered_eta_is_stamped_per_occurrence(redis_url, queue, client, TASK):
    app = registered(redis_url, queue, TASK)

    publisher = Publisher(app, "node-a")
    for minute in (0, 1):
        occ = Occurrence("nightly", AT + timedelta(minutes=minute))
        eta = occ.at + timedelta(seconds=7 + minute)
        d = Dispatch(occ, TASK, (1,), {}, {}, eta=eta)
        ours, celery_sent, _, _ = both_ways(app, client, queue, d, publisher=publisher)
        assert without_tag(ours) == without_tag(celery_sent)
        assert json.loads(ours)["headers"]["eta"] == eta.isoformat()
    assert len(publisher.templates) == 1  # the second occurrence was stamped from the first one's template


def test_an_unregistered_task_is_sent_by_name_like_send_task(redis_url, queue, client, TASK, recorder):
    app = make_app(redis_url, queue)
    d = Dispatch(occurrence(), "elsewhere.cleanup", (), {"days": 7}, {"queue": queue})
    ours, celery_sent, our_calls, celery_calls = both_ways(app, client, queue, d, recorder)
    assert without_tag(ours) == without_tag(celery_sent)
    assert our_calls == celery_calls


def test_a_template_serves_every_later_occurrence_with_its_own_id_and_headers(redis_url, queue, client, TASK):
    app = registered(redis_url, queue, TASK)

    publisher = Publisher(app, "node-a")
    occs = [Occurrence(f"e{i}", AT + timedelta(minutes=m)) for i in range(3) for m in range(2)]
    errors = publisher.publish([Dispatch(o, TASK, (i,), {}, {}) for i, o in enumerate(occs)])
    assert errors == [None] * len(occs)
    assert (publisher.stamped, publisher.celery_path, len(publisher.templates)) == (6, 0, 3)
    sent = [json.loads(r) for r in reversed(drain(client, queue))]  # LPUSH: newest first
    assert [m["headers"]["id"] for m in sent] == [o.task_id for o in occs]
    assert [m["headers"]["root_id"] for m in sent] == [o.task_id for o in occs]
    assert [m["properties"]["correlation_id"] for m in sent] == [o.task_id for o in occs]
    assert [(m["headers"]["cluster_beat_schedule"], m["headers"]["cluster_beat_scheduled_at"]) for m in sent] == \
        [(o.schedule, o.at.isoformat().replace("+00:00", "Z")) for o in occs]


def test_a_receiver_that_changes_headers_or_body_is_honoured_as_in_celery(redis_url, queue, client, TASK):
    """A ``before_task_publish`` receiver (tracing adds headers; rarely, one edits the body)
    sees and changes the message before it is serialised, as with Celery's own path."""
    app = make_app(redis_url, queue)

    @app.task(name=TASK)
    def report(*args, **kwargs):
        return None

    def tracer(sender=None, headers=None, body=None, **kw):
        headers["traceparent"] = "00-abc-01"
        body[1]["traced"] = True

    signals.before_task_publish.connect(tracer, weak=False)
    try:
        d = Dispatch(occurrence(), TASK, (1,), {"x": 1}, {})
        ours, celery_sent, _, _ = both_ways(app, client, queue, d)
    finally:
        signals.before_task_publish.disconnect(tracer)
    assert without_tag(ours) == without_tag(celery_sent)
    assert json.loads(ours)["headers"]["traceparent"] == "00-abc-01"


def test_a_router_function_sends_each_message_through_celerys_own_path(redis_url, queue, client, TASK):
    """A router function may answer differently per call: no template, Celery routes each one."""
    app = make_app(redis_url, queue)
    app.conf.task_routes = (lambda name, args, kwargs, options, task=None, **kw: {"queue": queue},)

    @app.task(name=TASK)
    def report(*args):
        return None

    d = Dispatch(occurrence(), TASK, (1,), {}, {})
    ours, celery_sent, _, _ = both_ways(app, client, queue, d, template=False)
    assert without_tag(ours) == without_tag(celery_sent)


def test_a_task_class_overriding_apply_async_keeps_its_per_call_code(redis_url, queue, client, TASK):
    app = make_app(redis_url, queue)
    calls = []

    class Counted(app.Task):
        def apply_async(self, *args, **kwargs):
            calls.append(kwargs["task_id"])
            return super().apply_async(*args, **kwargs)

    @app.task(name=TASK, base=Counted)
    def report(*args):
        return None

    d = Dispatch(occurrence(), TASK, (1,), {}, {})
    ours, celery_sent, _, _ = both_ways(app, client, queue, d, template=False)
    assert without_tag(ours) == without_tag(celery_sent)
    assert calls == [d.occurrence.task_id, d.occurrence.task_id]  # ours, then Celery's reference send


def test_a_tasks_own_relative_expires_is_computed_from_each_send_time(redis_url, queue, client, TASK, monkeypatch):
    """``@app.task(expires=30)``: apply_async merges it in, so each message expires 30 s after
    its own send, not 30 s after the template was built (a template built ahead would
    otherwise send messages that are already expired)."""
    app = make_app(redis_url, queue)

    @app.task(name=TASK, expires=30)
    def report(*args):
        return None

    publisher = Publisher(app, "node-a")
    built_at, sent_at = FROZEN, FROZEN + timedelta(seconds=60)
    monkeypatch.setattr(app, "now", lambda: built_at)
    d = Dispatch(occurrence(), TASK, (1,), {}, {})
    assert publisher.prepare(d)
    monkeypatch.setattr(app, "now", lambda: sent_at)
    ours, celery_sent, _, _ = both_ways(app, client, queue, d, publisher=publisher)
    assert without_tag(ours) == without_tag(celery_sent)
    assert json.loads(ours)["headers"]["expires"] == (sent_at + timedelta(seconds=30)).isoformat()


def test_apply_async_wrapped_globally_by_a_monitoring_library_keeps_its_per_call_code(
        redis_url, queue, client, TASK, monkeypatch):
    """Sentry's Celery integration replaces ``Task.apply_async`` with a ``functools.wraps``
    wrapper that adds a fresh trace header per call: every message goes through it."""
    import functools

    from celery.app.task import Task

    original = Task.apply_async
    traces = iter(range(1000))

    @functools.wraps(original)
    def traced(self, args=None, kwargs=None, **options):
        options["headers"] = dict(options.get("headers") or {}, trace=f"t-{next(traces)}")
        return original(self, args, kwargs, **options)

    monkeypatch.setattr(Task, "apply_async", traced)
    app = registered(redis_url, queue, TASK)

    publisher = Publisher(app, "node-a")
    occs = [Occurrence("nightly", AT + timedelta(minutes=m)) for m in range(3)]
    assert publisher.publish([Dispatch(o, TASK, (1,), {}, {}) for o in occs]) == [None] * 3
    assert (publisher.stamped, publisher.celery_path) == (0, 3)
    sent = [json.loads(r)["headers"]["trace"] for r in drain(client, queue)]
    assert sorted(sent) == ["t-0", "t-1", "t-2"]


def test_a_receiver_editing_one_messages_body_does_not_edit_the_next(redis_url, queue, client, TASK):
    """Celery builds a fresh body per call; so do we: an edit stays in its own message."""
    app = registered(redis_url, queue, TASK)

    def chain_first(sender=None, headers=None, body=None, **kw):
        if headers.get("cluster_beat_attempt") == 2:
            body[2]["chain"] = [{"task": "other"}]

    signals.before_task_publish.connect(chain_first, weak=False)
    try:
        publisher = Publisher(app, "node-a")
        first = Dispatch(Occurrence("nightly", AT), TASK, (1,), {}, {}, attempt=2)
        second = Dispatch(Occurrence("nightly", AT + timedelta(minutes=1)), TASK, (1,), {}, {})
        assert publisher.publish([first, second]) == [None, None]
    finally:
        signals.before_task_publish.disconnect(chain_first)
    assert publisher.stamped == 2
    import base64

    bodies = {json.loads(r)["headers"]["cluster_beat_attempt"]: json.loads(base64.b64decode(json.loads(r)["body"]))
              for r in drain(client, queue)}
    assert bodies[2][2]["chain"] == [{"task": "other"}]
    assert bodies[1][2]["chain"] is None
