"""Task messages built once per entry and stamped per occurrence.

Celery's per-message path (``apply_async`` -> ``send_task`` ->
``send_task_message``) repeats the same work on every fire of an entry: merging
the task's options, routing, ``saferepr`` of the arguments, building the
protocol-2 headers, serialising the same body, reading a dozen settings. At
thousands of messages a burst that work, not the broker, is what limits beat.

A :class:`Template` is what Celery's own code produces for one entry, taken
once: ``send_task`` runs for real with the entry's task, arguments, options and
headers, and is stopped where Celery hands the finished message to
``send_task_message`` (a thread-local switch in a wrapper around it), so the
capture publishes nothing and fires no signal. Per occurrence only what varies
is written into copies: the task id (``id``, ``root_id``, ``correlation_id``,
and the sent event's), ``eta`` (jitter), ``expires`` (a relative expiry) and
the values of our own ``cluster_beat_*`` headers. The rest of
``send_task_message`` is done per message as Celery does it: the
``before_task_publish`` / ``after_task_publish`` signals with the same
arguments, the result backend's ``on_task_call``, ``producer.publish`` with the
same routing and declarations, and the ``task-sent`` event when enabled. The
body is serialised once per entry unless a ``before_task_publish`` receiver is
connected (it could change the body, so it is then serialised after the signal,
as Celery does).

What cannot be replayed exactly is sent through Celery's own path, message by
message (:meth:`Templates.get` returns None, and :func:`why_not` says why once
in the log): a task class or app that overrides ``apply_async`` / ``send_task``
or a wrapped ``send_task_message`` (they may do something per call), a router
that is a function (it may answer differently per call), task protocol 1 (the id
is in the body), ``countdown`` or an absolute ``expires``/``eta`` in the options,
eager mode, receivers of the deprecated ``task_sent`` signal, a worker
callback's publish retry, and an ``eta`` (jitter) on quorum queues, which Celery
reroutes by the delay.
"""
from __future__ import annotations

import logging
import numbers
import os
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Dict, List, NamedTuple, Optional, Tuple

from celery import signals
from celery.app import amqp as celery_amqp
from celery.app.base import Celery
from celery.app.routes import MapRoute
from celery.app.task import Task
from celery.utils.time import maybe_make_aware
from kombu import Exchange
from kombu.common import Broadcast
from kombu.serialization import dumps

logger = logging.getLogger("celery_cluster_beat.publisher")

#: The task id a capture is made with; found only where Celery puts the id, or the entry is not replayable.
PLACEHOLDER = "cluster-beat-template-00000000-0000-0000-0000-000000000000"
#: Templates kept; the oldest built are dropped beyond it (rebuilt at their next fire).
MAX_TEMPLATES = 50_000
#: What Celery's send_task_message is called, unwrapped (the check that nobody else wraps it).
_STOCK_SENDER = "AMQP._create_task_sender.<locals>.send_task_message"

_capture = threading.local()

try:  # Celery 5.7 keeps naive datetimes naive and adds in UTC
    from celery.utils.time import add_seconds_to_datetime as _add_seconds
except ImportError:  # older Celery: plain addition
    def _add_seconds(dt: datetime, seconds: float) -> datetime:
        return dt + timedelta(seconds=seconds)


class _Captured(NamedTuple):
    name: str
    message: Any  # celery.app.amqp.task_message: headers, properties, body, sent_event
    options: Dict[str, Any]


def _celerys(func: Any, module_file: str, name: str) -> bool:
    """*func* is Celery's own *name* from *module_file* (``celery/app/task.py``...), not a
    subclass's override nor a wrapper patched over it (Sentry, tracing libraries): a wrapper
    copies the name with ``functools.wraps``, never the code object."""
    code = getattr(getattr(func, "__func__", func), "__code__", None)
    return code is not None and code.co_name == name and \
        code.co_filename.replace(os.sep, "/").endswith("/celery/app/" + module_file)


def _hook(app: Celery) -> bool:
    """Wrap the app's ``send_task_message`` once so a capture can stop there; False when it is
    not Celery's own (somebody else wraps it, and replaying would bypass them)."""
    amqp = app.amqp
    current = amqp.send_task_message
    if getattr(current, "__cluster_beat_capture__", False):
        return True
    if not _celerys(current, "amqp.py", "send_task_message"):
        return False

    def send_task_message(producer, name, message, **options):
        if getattr(_capture, "active", False):
            _capture.result = _Captured(name, message, options)
            return None
        return current(producer, name, message, **options)

    send_task_message.__cluster_beat_capture__ = True  # type: ignore[attr-defined]
    send_task_message.__wrapped__ = current  # type: ignore[attr-defined]
    amqp.send_task_message = send_task_message
    return True


def why_not(app: Celery, task_name: str, options: Dict[str, Any]) -> Optional[str]:
    """Why messages of this entry must take Celery's own path (None: they can be replayed)."""
    conf = app.conf
    if conf.task_always_eager:
        return "task_always_eager is set"
    if conf.task_protocol != 2:
        return f"task protocol {conf.task_protocol} (the task id is in the body)"
    if not _celerys(type(app).send_task, "base.py", "send_task"):
        return f"{type(app).__name__}.send_task is overridden or wrapped (it may do something per call)"
    task = app.tasks.get(task_name)
    if task is not None and not _celerys(type(task).apply_async, "task.py", "apply_async"):
        return f"{type(task).__name__}.apply_async is overridden or wrapped (it may do something per call)"
    amqp = app.amqp
    if not _celerys(amqp.create_task_message, "amqp.py", "as_task_v2"):
        return f"{type(amqp).__name__} builds task messages with its own code"
    if not all(isinstance(route, MapRoute) for route in amqp.routes):
        return "task_routes has a router function (it may route each call differently)"
    if "countdown" in options:
        return "the entry's options have a countdown (its eta depends on the send time)"
    if "eta" in options:
        return "the entry's options have an eta"
    expires = _effective_expires(task, options)
    if expires is not None and (isinstance(expires, bool) or not isinstance(expires, numbers.Real)):
        return "an absolute expires (its TTL depends on the send time)"
    if not _hook(app):
        return "the app's send_task_message is wrapped by other code"
    return None


def _effective_expires(task: Optional[Task], options: Dict[str, Any]) -> Any:
    """The ``expires`` a send of this entry uses: its options', else the task's own (as
    ``apply_async`` merges them)."""
    if "expires" in options:
        return options["expires"]
    return getattr(task, "expires", None) if task is not None else None


def _per_call_ok() -> bool:
    """What may change between calls and forbids replaying: deprecated task_sent receivers,
    and a worker callback's publish retry (Celery then publishes in a retry loop)."""
    return not signals.task_sent.receivers and not celery_amqp._callback_publish_retry.get()


@dataclass
class Template:
    """One entry's message as Celery builds it, ready to be stamped with an occurrence."""

    #: What it was built from (compared by identity: a changed entry has new objects).
    source: Tuple[Any, ...]
    name: str
    headers: Dict[str, Any]
    properties: Dict[str, Any]
    body: Any
    sent_event: Optional[Dict[str, Any]]
    exchange: Any
    routing_key: Optional[str]
    qname: Optional[str]
    declare: Optional[List[Any]]
    delivery_mode: Any
    retry: bool
    retry_policy: Dict[str, Any]
    serializer: Optional[str]
    compression: Optional[str]
    timeout: Any
    confirm_timeout: Any
    event_dispatcher: Any
    ignore_result: bool
    #: (content_type, content_encoding, payload) of the body, serialised once.
    payload: Tuple[str, str, Any]
    #: A relative ``expires`` (seconds): the header is recomputed from the send time.
    expires_seconds: Optional[float]
    #: An eta may be stamped in (no quorum queue reroutes it).
    eta_ok: bool
    thread: int

    def stamp(self, app: Celery, task_id: str, eta: Optional[datetime], dynamic: Dict[str, Any]):
        """Headers, properties and sent event of one occurrence (fresh dicts, as Celery's)."""
        headers = self.headers.copy()
        headers["id"] = headers["root_id"] = task_id
        if eta is not None:
            headers["eta"] = eta.isoformat()
        if self.expires_seconds is not None:
            headers["expires"] = maybe_make_aware(_add_seconds(app.now(), self.expires_seconds),
                                                  tz=app.timezone).isoformat()
        headers.update(dynamic)
        properties = self.properties.copy()
        properties["correlation_id"] = task_id
        sent_event = None
        if self.sent_event is not None:
            sent_event = self.sent_event.copy()
            sent_event["uuid"] = sent_event["root_id"] = task_id
            sent_event["eta"] = headers["eta"]
            sent_event["expires"] = headers["expires"]
        return headers, properties, sent_event

    def send(self, app: Celery, producer, task_id: str, eta: Optional[datetime], dynamic: Dict[str, Any], *,
             declare: bool, backend) -> None:
        """Publish one occurrence the way ``send_task`` + ``send_task_message`` would."""
        headers, properties, sent_event = self.stamp(app, task_id, eta, dynamic)
        # A fresh body as Celery builds per call (args and kwargs are the entry's own objects, as
        # there): a receiver that edits it edits this message only.
        args, kwargs, embed = self.body
        body = (args, kwargs, dict(embed))
        name, exchange, routing_key = self.name, self.exchange, self.routing_key
        with producer.connection._reraise_as_library_errors():
            if not self.ignore_result:
                backend.on_task_call(producer, task_id)
            entities = list(self.declare) if (declare and self.declare) else ([] if self.declare is not None else None)
            retry_policy = dict(self.retry_policy)
            content: Dict[str, Any] = {}
            if signals.before_task_publish.receivers:
                # A receiver may change the body: serialise it after the signal, as Celery does.
                signals.before_task_publish.send(
                    sender=name, body=body, exchange=exchange, routing_key=routing_key, declare=entities,
                    headers=headers, properties=properties, retry_policy=retry_policy,
                )
                payload = body
            else:
                content_type, content_encoding, payload = self.payload
                content = {"content_type": content_type, "content_encoding": content_encoding}
            producer.publish(
                payload, exchange=exchange, routing_key=routing_key, serializer=self.serializer,
                compression=self.compression, retry=self.retry, retry_policy=retry_policy,
                delivery_mode=self.delivery_mode, declare=entities, headers=headers, timeout=self.timeout,
                confirm_timeout=self.confirm_timeout, **content, **properties,
            )
            signals.after_task_publish.send(sender=name, body=body, headers=headers, exchange=exchange,
                                            routing_key=routing_key)
            if sent_event is not None:
                evd = self.event_dispatcher or app.amqp._event_dispatcher
                sent_event.update({"queue": self.qname,
                                   "exchange": exchange.name if isinstance(exchange, Exchange) else exchange,
                                   "routing_key": routing_key})
                evd.publish("task-sent", sent_event, producer, retry=self.retry, retry_policy=retry_policy)


class Templates:
    """The templates of one beat process, by schedule name, built when first needed."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._by_name: Dict[str, Template] = {}
        #: Entries that must take Celery's path, with the source they were judged on.
        self._refused: Dict[str, Tuple[Any, ...]] = {}
        self._told: set = set()

    def __len__(self) -> int:
        return len(self._by_name)

    def has(self, name: str) -> bool:
        """A template or a refusal is held for *name* (it need not be prepared again)."""
        return name in self._by_name or name in self._refused

    def get(self, name: str, task: str, args, kwargs, options: Dict[str, Any], headers: Dict[str, Any],
            producer, *, eta: bool) -> Optional[Template]:
        """The template for this entry as it is now, built if missing or stale; None: send it
        through Celery's own path."""
        if not _per_call_ok():
            return None
        source = (task, args, kwargs, options, tuple(headers))
        tpl = self._by_name.get(name)
        if tpl is None or not _same(tpl.source, source) or tpl.thread != threading.get_ident():
            refused = self._refused.get(name)
            if refused is not None and _same(refused, source):
                return None
            tpl, reason = self._build(name, source, task, args, kwargs, options, headers, producer)
            if tpl is None:
                if reason is not None:  # for good (until the entry changes); else tried again next time
                    if len(self._refused) >= MAX_TEMPLATES:
                        self._refused.pop(next(iter(self._refused)))
                    self._refused[name] = source
                    self._tell(name, reason)
                return None
            self._refused.pop(name, None)
            if len(self._by_name) >= MAX_TEMPLATES:
                self._by_name.pop(next(iter(self._by_name)))
            self._by_name[name] = tpl
        if eta and not tpl.eta_ok:
            return None
        return tpl

    def _tell(self, name: str, reason: str) -> None:
        """Say once per reason (at INFO) that entries take Celery's per-message path; each entry at DEBUG."""
        if reason not in self._told:
            self._told.add(reason)
            logger.info("cluster-beat: %s and other entries for the same reason are sent through Celery's "
                        "per-message path: %s", name, reason)
        logger.debug("cluster-beat: %s is sent through Celery's per-message path: %s", name, reason)

    def _build(self, name, source, task, args, kwargs, options, headers,
               producer) -> Tuple[Optional[Template], Optional[str]]:
        """The template, or None and why it cannot be made (None: it failed this time, as the
        send through Celery's path will show)."""
        app = self.app
        reason = why_not(app, task, options)
        if reason is not None:
            return None, reason
        try:
            captured = _capture_send(app, task, args, kwargs, options, headers, producer)
        except Exception as exc:  # the same error comes back from Celery's path, per message
            logger.debug("cluster-beat: %s: building its message failed (%r)", name, exc)
            return None, None
        if captured is None:
            return None, "send_task did not reach send_task_message"
        tpl = _template(app, source, captured)
        if tpl is None:
            return None, "the message holds the task id outside the places Celery puts it"
        return tpl, None


def _same(a: Tuple[Any, ...], b: Tuple[Any, ...]) -> bool:
    """Built from the same entry: same task name and header names, the very same args, kwargs
    and options objects (an equal copy may differ in type: (1,) == (True,))."""
    return a[0] == b[0] and a[4] == b[4] and all(x is y for x, y in zip(a[1:4], b[1:4]))


def _capture_send(app: Celery, task_name: str, args, kwargs, options, headers, producer) -> Optional[_Captured]:
    """Run Celery's own send for this call, stopped before anything is published."""
    _capture.active, _capture.result = True, None
    try:
        options = {k: v for k, v in options.items() if k != "headers"}  # the call's headers come apart
        task = app.tasks.get(task_name)
        if task is not None:
            task.apply_async(args, kwargs, task_id=PLACEHOLDER, producer=producer, headers=dict(headers), **options)
        else:
            app.send_task(task_name, args, kwargs, task_id=PLACEHOLDER, producer=producer, headers=dict(headers),
                          **options)
        return _capture.result
    finally:
        _capture.active, _capture.result = False, None
        _forget_placeholder(app)


def _forget_placeholder(app: Celery) -> None:
    """``send_task`` told the result backend about the placeholder id (``on_task_call``: the
    Redis backend subscribes to its result channel); take that back."""
    consumer = getattr(app.backend, "result_consumer", None)
    cancel = getattr(consumer, "cancel_for", None)
    if cancel is not None:
        try:
            cancel(PLACEHOLDER)
        except Exception:  # nothing was subscribed, or the backend is unreachable: harmless
            logger.debug("cluster-beat: could not drop the template's result subscription", exc_info=True)


def _template(app: Celery, source, captured: _Captured) -> Optional[Template]:
    """``send_task_message``'s work up to the signals, done once (mirrors Celery 5's sender)."""
    conf, amqp = app.conf, app.amqp
    headers2, properties, body, sent_event = captured.message
    options = dict(captured.options)
    pop = options.pop
    exchange, routing_key, queue = pop("exchange", None), pop("routing_key", None), pop("queue", None)
    event_dispatcher = pop("event_dispatcher", None)
    retry, retry_policy = pop("retry", None), pop("retry_policy", None)
    serializer, delivery_mode = pop("serializer", None), pop("delivery_mode", None)
    compression, declare = pop("compression", None), pop("declare", None)
    headers, exchange_type = pop("headers", None), pop("exchange_type", None)
    timeout, confirm_timeout = pop("timeout", None), pop("confirm_timeout", None)
    headers2 = dict(headers2)
    if headers:
        headers2.update(headers)
    properties = dict(properties)
    if options:
        properties.update(options)
    if (headers2.get("id"), headers2.get("root_id"), properties.get("correlation_id")) != (PLACEHOLDER,) * 3:
        return None
    if sent_event is not None:
        sent_event = dict(sent_event)
        if (sent_event.get("uuid"), sent_event.get("root_id")) != (PLACEHOLDER, PLACEHOLDER):
            return None
    rest = {k: v for k, v in headers2.items() if k not in ("id", "root_id")}
    if PLACEHOLDER in repr(rest) or PLACEHOLDER in repr(body):
        return None  # the id is somewhere else too: stamping would leave it behind
    qname = queue
    if queue is None and exchange is None:
        queue = amqp.default_queue
    if queue is not None:
        if isinstance(queue, str):
            qname, queue = queue, amqp.queues[queue]
        else:
            qname = queue.name
    if delivery_mode is None:
        try:
            delivery_mode = queue.exchange.delivery_mode
        except AttributeError:
            pass
        delivery_mode = delivery_mode or conf.task_default_delivery_mode
    if exchange_type is None:
        try:
            exchange_type = queue.exchange.type
        except AttributeError:
            exchange_type = "direct"
    if (not exchange or not routing_key) and exchange_type == "direct":
        exchange, routing_key = "", qname
    elif exchange is None:
        exchange = queue.exchange.name or amqp.default_exchange
        routing_key = routing_key or queue.routing_key or conf.task_default_routing_key
    if declare is None and queue and not isinstance(queue, Broadcast):
        declare = [queue]
    retry = conf.task_publish_retry if retry is None else retry
    policy = dict(conf.task_publish_retry_policy, **retry_policy) if retry_policy else dict(
        conf.task_publish_retry_policy)
    serializer = serializer or conf.task_serializer
    payload = dumps(body, serializer=serializer)
    expires = _effective_expires(app.tasks.get(source[0]), source[3])
    if headers2.get("expires") is not None and expires is None:
        return None  # an expiry from somewhere this module does not know how to recompute
    try:
        from celery.utils.quorum_queues import detect_quorum_queues

        driver = app.producer_pool.connections.connection.transport.driver_type
        eta_ok = not detect_quorum_queues(app, driver)[0]
    except Exception:  # unknown transport or an older Celery without native delayed delivery
        eta_ok = True
    return Template(
        source=source, name=captured.name, headers=headers2, properties=properties, body=body,
        sent_event=sent_event, exchange=exchange, routing_key=routing_key, qname=qname, declare=declare,
        delivery_mode=delivery_mode, retry=retry, retry_policy=policy, serializer=serializer,
        compression=compression or conf.task_compression, timeout=timeout, confirm_timeout=confirm_timeout,
        event_dispatcher=event_dispatcher, ignore_result=bool(headers2.get("ignore_result")), payload=payload,
        expires_seconds=None if expires is None else float(expires), eta_ok=eta_ok, thread=threading.get_ident(),
    )
