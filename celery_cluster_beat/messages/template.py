"""Task messages built once per entry and stamped per occurrence.

Celery's per-message path (``apply_async`` -> ``send_task`` ->
``send_task_message``) repeats the same work on every fire of an entry: merging
the task's options, routing, ``saferepr`` of the arguments, building the
protocol-2 headers, serialising the same body, reading a dozen settings. At
thousands of messages a burst that work, not the broker, is what limits beat.

A :class:`Template` is what the installed Celery's own code does for one entry,
recorded once (:mod:`.celerysend`): the ``publish`` call it makes on the producer,
the arguments of ``before_task_publish`` / ``after_task_publish`` and of the
``task-sent`` event. Per occurrence only what varies is written into copies: the
task id (``id``, ``root_id``, ``correlation_id``, and the sent event's), ``eta``
(jitter), ``expires`` (a relative expiry) and the values of our own
``cluster_beat_*`` headers; the signals fire and the producer publishes with the
same arguments Celery passes, whatever its minor. The body is serialised once per
entry unless a ``before_task_publish`` receiver is connected (it could change the
body, so it is then serialised after the signal, as Celery does).

Before a template of a new *shape* (task class, option keys, header names,
receivers connected, sent events) is first used, :mod:`.selfcheck` builds one
message both ways and compares them; a difference sends that shape through
Celery's own path, with one log line naming the entry and the field.

What cannot be replayed exactly is sent through Celery's own path, message by
message (:meth:`Templates.get` returns None, and the log says why once): a task
class or app that overrides ``apply_async`` / ``send_task`` or a wrapped
``send_task_message`` (they may do something per call), a router that is a
function (it may answer differently per call), task protocol 1 (the id is in the
body), ``countdown`` or an absolute ``expires``/``eta`` in the options, eager mode,
receivers of the deprecated ``task_sent`` signal, a worker callback's publish
retry, an ``eta`` (jitter) on quorum queues, which Celery reroutes by the delay,
and anything :func:`.celerysend.blocker` finds different in this Celery.
"""
from __future__ import annotations

import copy
import logging
import numbers
import threading
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Dict, Optional, Tuple

from celery import signals
from celery.app.base import Celery
from celery.app.routes import MapRoute
from celery.app.task import Task
from celery.utils.time import maybe_make_aware
from kombu.compression import get_encoder
from kombu.serialization import dumps

from . import celerysend
from .celerysend import PLACEHOLDER, celerys, record_send

logger = logging.getLogger("celery_cluster_beat.publisher")

try:  # Celery 5.7 keeps naive datetimes naive and adds in UTC
    from celery.utils.time import add_seconds_to_datetime as _add_seconds
except ImportError:  # older Celery: plain addition
    def _add_seconds(dt: datetime, seconds: float) -> datetime:
        return dt + timedelta(seconds=seconds)


class TemplateBroken(Exception):
    """Replaying a template failed before anything was sent: Celery's own path can take it."""


def _fresh_copy(value: Dict[str, Any]) -> Dict[str, Any]:
    """A copy whose nested lists and dicts are this message's own, as Celery builds them per
    call (``timelimit``, ``stamps``, ``callbacks``...): a receiver editing one edits one message."""
    return {k: copy.deepcopy(v) if isinstance(v, (list, dict)) else v for k, v in value.items()}


def why_not(app: Celery, task_name: str, options: Dict[str, Any]) -> Optional[str]:
    """Why messages of this entry must take Celery's own path (None: they can be replayed)."""
    conf = app.conf
    if conf.task_always_eager:
        return "task_always_eager is set"
    if conf.task_protocol != 2:
        return f"task protocol {conf.task_protocol} (the task id is in the body)"
    # The bound methods: a wrapper set on the instance counts as much as one on the class.
    if not celerys(app.send_task, "base.py", "send_task"):
        return f"{type(app).__name__}.send_task is overridden or wrapped (it may do something per call)"
    task = app.tasks.get(task_name)
    if task is not None and not celerys(task.apply_async, "task.py", "apply_async"):
        return f"{type(task).__name__}.apply_async is overridden or wrapped (it may do something per call)"
    if task is not None and not celerys(task.shadow_name, "task.py", "shadow_name"):
        return f"{type(task).__name__} has its own shadow_name (it may name each call differently)"
    amqp = app.amqp
    if not celerys(amqp.create_task_message, "amqp.py", "as_task_v2"):
        return f"{type(amqp).__name__} builds task messages with its own code"
    if not all(isinstance(route, MapRoute) for route in amqp.routes):
        return "task_routes has a router function (it may route each call differently)"
    if "countdown" in options:
        return "the entry's options have a countdown (its eta depends on the send time)"
    if "eta" in options:
        return "the entry's options have an eta"
    expires = effective_expires(task, options)
    if expires is not None and (isinstance(expires, bool) or not isinstance(expires, numbers.Real)):
        return "an absolute expires (its TTL depends on the send time)"
    if not celerysend.hook(app):
        return "the app's send_task_message is wrapped by other code"
    return None


def effective_expires(task: Optional[Task], options: Dict[str, Any]) -> Any:
    """The ``expires`` a send of this entry uses: its options', else the task's own (as
    ``apply_async`` merges them)."""
    if "expires" in options:
        return options["expires"]
    return getattr(task, "expires", None) if task is not None else None


def _bind(recorded: Optional[Dict[str, Any]], fresh: Dict[int, Any]) -> Dict[str, Any]:
    """A recorded call's keyword arguments with each per-message object (by identity) replaced by
    this message's own: Celery passes the very same objects to the producer and the signals."""
    return {k: fresh.get(id(v), v) for k, v in (recorded or {}).items()}


@dataclass
class Template:
    """One entry's message as this Celery sends it, ready to be stamped with an occurrence."""

    #: What it was built from (compared by identity: a changed entry has new objects).
    source: Tuple[Any, ...]
    name: str
    headers: Dict[str, Any]
    properties: Dict[str, Any]
    body: Any
    sent_event: Optional[Dict[str, Any]]
    #: The producer's publish arguments other than the body, the headers and the properties.
    publish: Dict[str, Any]
    #: The recorded signal and event arguments (per-message objects rebound by identity).
    before: Optional[Dict[str, Any]]
    after: Optional[Dict[str, Any]]
    event_args: Tuple[Any, ...]
    event_kwargs: Dict[str, Any]
    #: id() of the recorded per-message objects, by role (for :func:`_bind`).
    recorded_ids: Dict[str, int]
    event_dispatcher: Any
    ignore_result: bool
    #: (content_type, content_encoding, payload) of the body, serialised once.
    payload: Tuple[str, str, Any]
    #: A relative ``expires`` (seconds): the header is recomputed from the send time.
    expires_seconds: Optional[float]
    #: An eta may be stamped in (no quorum queue reroutes it).
    eta_ok: bool
    thread: int
    #: Which self-check shape it belongs to (see :mod:`.selfcheck`).
    shape: Tuple[Any, ...] = ()

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

    def _prepared(self, app: Celery, task_id: str, eta: Optional[datetime], dynamic: Dict[str, Any],
                  declare: bool):
        """Everything one send passes on, fresh per message as Celery's are."""
        headers, properties, sent_event = self.stamp(app, task_id, eta, dynamic)
        # A fresh body as Celery builds per call (args and kwargs are the entry's own objects, as
        # there): a receiver that edits it edits this message only.
        args, kwargs, embed = self.body
        body = (args, kwargs, dict(embed))
        publish = dict(self.publish)
        recorded_declare = publish.get("declare")
        entities = list(recorded_declare) if (declare and recorded_declare) else (
            [] if recorded_declare is not None else None)
        publish["declare"] = entities
        policy = publish.get("retry_policy")
        if isinstance(policy, dict):
            publish["retry_policy"] = policy = dict(policy)
        return body, headers, properties, sent_event, publish

    def _fresh(self, body, headers, properties, sent_event, publish) -> Dict[int, Any]:
        """This message's own objects by the id() of the recorded ones they stand for."""
        ids = self.recorded_ids
        fresh = {ids["body"]: body, ids["headers"]: headers, ids["properties"]: properties}
        if ids.get("declare") is not None:
            fresh[ids["declare"]] = publish["declare"]
        if ids.get("retry_policy") is not None:
            fresh[ids["retry_policy"]] = publish["retry_policy"]
        if ids.get("sent_event") is not None:
            fresh[ids["sent_event"]] = sent_event
        return fresh

    def send(self, app: Celery, producer, task_id: str, eta: Optional[datetime], dynamic: Dict[str, Any], *,
             declare: bool, backend, event_dispatcher=None) -> None:
        """Publish one occurrence the way ``send_task`` + ``send_task_message`` would.

        Raises :class:`TemplateBroken` when stamping fails or kombu refuses the call, before
        anything is sent: Celery's own path can then send it."""
        try:
            body, headers, properties, sent_event, publish = self._prepared(app, task_id, eta, dynamic, declare)
            fresh = None  # built when a signal or the sent event needs it
            reraise = producer.connection._reraise_as_library_errors
        except Exception as exc:
            raise TemplateBroken(repr(exc)) from exc
        with reraise():
            if not self.ignore_result:
                backend.on_task_call(producer, task_id)
            content: Dict[str, Any] = {}
            if self.before is not None and signals.before_task_publish.receivers:
                # What kombu would refuse is refused here, before receivers see a send that fails.
                try:
                    if publish.get("compression"):
                        get_encoder(publish["compression"])
                except Exception as exc:
                    raise TemplateBroken(repr(exc)) from exc
                # A receiver may change the body: serialise it after the signal, as Celery does;
                # and it may edit nested values, which must be this message's own.
                headers, properties = _fresh_copy(headers), _fresh_copy(properties)
                body = (body[0], body[1], _fresh_copy(body[2]))
                fresh = self._fresh(body, headers, properties, sent_event, publish)
                named = _bind(self.before, fresh)
                signals.before_task_publish.send(sender=named.pop("sender"), **named)
                payload = body
            else:
                content_type, content_encoding, payload = self.payload
                content = {"content_type": content_type, "content_encoding": content_encoding}
            try:
                producer.publish(payload, headers=headers, **publish, **content, **properties)
            except (TypeError, ValueError, AttributeError, KeyError) as exc:
                # kombu refused the call itself (a broker error is none of these): nothing went out
                raise TemplateBroken(repr(exc)) from exc
            if self.after is not None and signals.after_task_publish.receivers:
                fresh = fresh or self._fresh(body, headers, properties, sent_event, publish)
                named = _bind(self.after, fresh)
                signals.after_task_publish.send(sender=named.pop("sender"), **named)
            if sent_event is not None:
                evd = event_dispatcher or self.event_dispatcher
                kind, _, *rest = self.event_args
                fresh = fresh or self._fresh(body, headers, properties, sent_event, publish)
                evd.publish(kind, sent_event, producer, *rest[1:], **_bind(self.event_kwargs, fresh))


def build(app: Celery, source: Tuple[Any, ...], captured) -> Tuple[Optional[Template], Optional[str]]:
    """The template of a captured send, or None and why it cannot be replayed."""
    recording, headers, properties = record_send(app, captured)
    call = recording.publish
    if call is None or recording.extra:
        return None, f"Celery's send did more than one publish ({', '.join(recording.extra) or 'none'})"
    body = captured.message[2]
    if call.args[0] is not body or call.kwargs.get("headers") is not headers:
        return None, "Celery's send published other objects than its message"
    if not isinstance(body, tuple) or len(body) != 3:
        return None, "the body is not a protocol-2 (args, kwargs, embed) tuple"
    publish = {k: v for k, v in call.kwargs.items() if k != "headers" and k not in properties}
    missing = object()
    if any(call.kwargs.get(k, missing) is not v for k, v in properties.items()):
        return None, "Celery's send published other properties than its message's"
    if "content_type" in publish or "content_encoding" in publish:
        return None, "the options set content_type itself"
    if (headers.get("id"), headers.get("root_id"), properties.get("correlation_id")) != (PLACEHOLDER,) * 3:
        return None, "the message holds the task id outside the places Celery puts it"
    sent_event = captured.message[3]
    event_args: Tuple[Any, ...] = ()
    event_kwargs: Dict[str, Any] = {}
    evd = None
    if sent_event is not None:
        if recording.event is None or len(recording.event.args) < 3:
            return None, "the task-sent event was not published as expected"
        event_args, event_kwargs = recording.event.args, recording.event.kwargs
        sent_event = dict(event_args[1])
        if (sent_event.get("uuid"), sent_event.get("root_id")) != (PLACEHOLDER, PLACEHOLDER):
            return None, "the message holds the task id outside the places Celery puts it"
        evd = captured.options.get("event_dispatcher") or getattr(app.amqp, "_event_dispatcher", None)
        if evd is None:
            return None, "Celery's default event dispatcher is not where this Celery version keeps it"
    rest = {k: v for k, v in headers.items() if k not in ("id", "root_id")}
    if PLACEHOLDER in repr(rest) or PLACEHOLDER in repr(body):
        return None, "the message holds the task id outside the places Celery puts it"
    expires = effective_expires(app.tasks.get(source[0]), source[3])
    if headers.get("expires") is not None and expires is None:
        return None, "an expiry from somewhere this module does not know how to recompute"
    recorded_ids = {"body": id(body), "headers": id(headers), "properties": id(properties),
                    "declare": id(publish["declare"]) if publish.get("declare") is not None else None,
                    "retry_policy": id(publish["retry_policy"]) if isinstance(publish.get("retry_policy"), dict)
                    else None,
                    "sent_event": id(recording.event.args[1]) if recording.event is not None else None}
    payload = dumps(body, serializer=publish.get("serializer"))
    return Template(
        source=source, name=captured.name, headers=headers, properties=properties, body=body,
        sent_event=sent_event, publish=publish, before=recording.before, after=recording.after,
        event_args=event_args, event_kwargs=event_kwargs, recorded_ids=recorded_ids, event_dispatcher=evd,
        ignore_result=bool(headers.get("ignore_result")), payload=payload,
        expires_seconds=None if expires is None else float(expires), eta_ok=_eta_ok(app),
        thread=threading.get_ident(),
    ), None


def _eta_ok(app: Celery) -> bool:
    """False when Celery reroutes an eta (native delayed delivery for quorum queues, 5.5+)."""
    try:
        from celery.utils.quorum_queues import detect_quorum_queues
    except ImportError:  # before 5.5: an eta never changes the routing
        return True
    try:
        driver = app.producer_pool.connections.connection.transport.driver_type
        return not detect_quorum_queues(app, driver)[0]
    except Exception:  # the transport cannot tell: let Celery route each eta
        return False
