"""The fast path proves itself, once per shape of message, in this process.

A template replays what the installed Celery did for one entry; whether stamping an
occurrence into it gives what Celery would send for that occurrence depends on the
Celery and kombu at hand. So before a template of a new *shape* is first used (task
base class, option keys, header names, receivers connected, sent events, relative
expiry, ignore_result: not once per entry, start-up stays cheap with 20,000 entries)
one occurrence is built both ways, nothing published:

* Celery's way: ``apply_async`` / ``send_task`` with the occurrence's id and eta,
  stopped at ``send_task_message``, which then runs with recording producer and
  event dispatcher (:mod:`.celerysend`);
* ours: the template stamped and sent into the same recorders.

The producer's ``publish`` call (the body compared serialised), the signal arguments
and the ``task-sent`` event must be the same, but for a relative ``expires`` computed
from two clock readings a moment apart. :func:`verify` returns the first difference
(the field), or None.
"""
from __future__ import annotations

import uuid
from datetime import datetime, timedelta, timezone
from typing import Any, Dict, Optional, Tuple

from celery import signals
from celery.app.base import Celery
from kombu.serialization import dumps

from .celerysend import Recording, RecordingDispatcher, RecordingProducer, capture_send, record_send
from .celerysend import recording_signals
from .template import Template

#: Two expiry stamps this close are the same (each side reads the clock once).
EXPIRES_SLACK = timedelta(seconds=5)
#: The eta the check stamps (any instant in the future does).
CHECK_ETA = timedelta(seconds=37)


def shape_of(app: Celery, tpl: Template, options: Dict[str, Any], headers: Dict[str, Any]) -> Tuple[Any, ...]:
    """What decides how a template is stamped and replayed; entries of one shape share a check."""
    task = app.tasks.get(tpl.source[0])
    cls = type(task) if task is not None else None
    if cls is not None and cls.__dict__.get("_decorated"):  # @app.task makes a class per task: its base
        cls = cls.__mro__[1]
    return (cls, tuple(sorted(map(repr, options))), tuple(sorted(map(repr, headers))),
            bool(signals.before_task_publish.receivers), bool(signals.after_task_publish.receivers),
            tpl.sent_event is not None, tpl.expires_seconds is not None, tpl.ignore_result)


class _NoBackend:
    def on_task_call(self, producer, task_id):
        return None


def verify(app: Celery, tpl: Template, task: str, args, kwargs, options: Dict[str, Any],
           headers: Dict[str, Any], producer) -> Optional[str]:
    """The first field in which the template's message differs from Celery's (None: none)."""
    task_id = f"cluster-beat-selfcheck-{uuid.uuid4()}"
    etas = [None]
    if tpl.eta_ok:
        etas.append(datetime.now(timezone.utc).replace(microsecond=0) + CHECK_ETA)
    for eta in etas:
        try:
            captured = capture_send(app, task, args, kwargs, options, headers, producer, task_id=task_id, eta=eta)
            if captured is None:
                return "send_task_message (Celery's send did not reach it)"
            theirs, _, _ = record_send(app, captured, mirror=True)
            mine = Recording()
            with recording_signals(mine, mirror=True):
                tpl.send(app, RecordingProducer(mine), task_id, eta, headers, declare=True, backend=_NoBackend(),
                         event_dispatcher=RecordingDispatcher(mine))
        except Exception as exc:  # whatever fails here would fail a send: Celery's path decides
            return f"the check itself ({exc!r})"
        where = _difference(theirs, mine)
        if where is not None:
            return where + (" (with an eta)" if eta is not None else "")
    return None


def _difference(theirs: Recording, mine: Recording) -> Optional[str]:
    if theirs.extra or mine.extra:
        return f"calls made ({theirs.extra} / {mine.extra})"
    if (theirs.publish is None) != (mine.publish is None):
        return "publish (made by one side only)"
    if theirs.publish is not None:
        kw_theirs, kw_mine = dict(theirs.publish.kwargs), dict(mine.publish.kwargs)
        serializer = kw_theirs.get("serializer")
        body_theirs = dumps(theirs.publish.args[0], serializer=serializer)
        if "content_type" in kw_mine and "content_type" not in kw_theirs:
            body_mine = (kw_mine.pop("content_type"), kw_mine.pop("content_encoding", None), mine.publish.args[0])
        else:
            body_mine = dumps(mine.publish.args[0], serializer=kw_mine.get("serializer"))
        if body_theirs != body_mine:
            return "body"
        where = _kwargs_differ(kw_theirs, kw_mine, "publish")
        if where:
            return where
    for name in ("before", "after"):
        a, b = getattr(theirs, name), getattr(mine, name)
        if (a is None) != (b is None):
            return f"{name}_task_publish (sent by one side only)"
        if a is not None:
            a, b = dict(a), dict(b)
            if dumps(a.pop("body", None), serializer="json") != dumps(b.pop("body", None), serializer="json"):
                return f"{name}_task_publish(body)"
            where = _kwargs_differ(a, b, f"{name}_task_publish")
            if where:
                return where
    if (theirs.event is None) != (mine.event is None):
        return "task-sent event (sent by one side only)"
    if theirs.event is not None:
        a, b = theirs.event, mine.event
        if a.args[0] != b.args[0] or len(a.args) != len(b.args):
            return "task-sent event (arguments)"
        where = _dict_differ(a.args[1], b.args[1], "task-sent event") or \
            _kwargs_differ(a.kwargs, b.kwargs, "task-sent event")
        if where:
            return where
    return None


def _kwargs_differ(a: Dict[str, Any], b: Dict[str, Any], what: str) -> Optional[str]:
    # Properties and headers go on the wire in the order given: the order is part of the message.
    if [k for k in a if k != "headers"] != [k for k in b if k != "headers"]:
        return f"{what}(the order of its arguments)"
    for key in sorted(set(a) | set(b)):
        if (key in a) != (key in b):
            return f"{what}({key}: passed by {'Celery' if key in a else 'the template'} only)"
        if key == "headers":
            where = _dict_differ(a[key] or {}, b[key] or {}, "header")
            if where:
                return where
        elif not _same(a[key], b[key]):
            return f"{what}({key})"
    return None


def _dict_differ(a: Dict[str, Any], b: Dict[str, Any], what: str) -> Optional[str]:
    if set(a) == set(b) and list(a) != list(b):
        return f"{what}s (their order)"
    for key in sorted(set(a) | set(b)):
        if (key in a) != (key in b):
            return f"{what} {key} (in {'Celery' if key in a else 'the template'}'s only)"
        if key == "expires" and _close_expiry(a[key], b[key]):
            continue
        if not _same(a[key], b[key]):
            return f"{what} {key}"
    return None


def _close_expiry(a: Any, b: Any) -> bool:
    try:
        return abs(datetime.fromisoformat(a) - datetime.fromisoformat(b)) <= EXPIRES_SLACK
    except (TypeError, ValueError):
        return False


def _same(a: Any, b: Any) -> bool:
    try:
        return bool(a == b) and type(a) is type(b)
    except Exception:  # an object that cannot be compared: only itself is the same
        return a is b
