"""Celery's own send path, run and recorded without publishing anything.

The fast path (:mod:`.messages`) replays what Celery does for an entry instead of
redoing it per message. What Celery does differs between minors (5.3 and 5.4 pass
no ``timeout`` / ``confirm_timeout`` to kombu; before 5.7 ``before_task_publish``
receives the caller's ``retry_policy``, from 5.7 the merged one; 5.7 adds a publish
retry loop for worker callbacks...). Rather than mirror each version's
``send_task_message``, we run the installed one and record what it does:

* :func:`capture_send` runs ``apply_async`` / ``send_task`` for real and stops where
  Celery hands the finished message to ``app.amqp.send_task_message`` (a wrapper
  installed once on the app, switched by a thread-local flag);
* :func:`record_send` then runs the app's real ``send_task_message`` on that message
  with a producer and an event dispatcher that only record, and with the
  ``before_task_publish`` / ``after_task_publish`` receivers swapped for recorders
  for the duration of the call: no user receiver sees a message that is never sent.

Celery and kombu privates are read here only, each behind a check: when one is
missing or not what we expect (:func:`blocker`), the fast path is off and every
message takes Celery's own path; sending never depends on them.
"""
from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from celery import __version__ as CELERY_VERSION
from celery import signals
from celery.app.base import Celery
from celery.utils.dispatch import Signal

from .support import minor

logger = logging.getLogger("celery_cluster_beat.publisher")

#: The task id a capture is made with; found only where Celery puts the id, or the entry is not replayable.
PLACEHOLDER = "cluster-beat-template-00000000-0000-0000-0000-000000000000"


#: The privates the fast path reads: (module, attribute, first Celery version that has it).
#: Missing on a version that should have it, the fast path is off (see :func:`blocker`).
PRIVATES: Dict[str, Tuple[str, str, Tuple[int, ...]]] = {
    # Set while a worker publishes a callback: Celery 5.7 then publishes in its own retry loop.
    "callback_publish_retry": ("celery.app.amqp", "_callback_publish_retry", (5, 7)),
}

_capture = threading.local()
_swap_lock = threading.RLock()


class _Captured(NamedTuple):
    name: str
    message: Any  # celery.app.amqp.task_message: headers, properties, body, sent_event
    options: Dict[str, Any]


def _private(module: str, attr: str) -> Tuple[bool, Any]:
    """(present, value) of a private."""
    try:
        mod = importlib.import_module(module)
    except ImportError:
        return False, None
    missing = object()
    value = getattr(mod, attr, missing)
    return value is not missing, (None if value is missing else value)


_CELERY = minor(CELERY_VERSION)
#: What :func:`blocker` read of :data:`PRIVATES` last: (their spec, a static reason or None, the ContextVars).
_read: Tuple[Any, Optional[str], Tuple[Any, ...]] = (None, None, ())


def _static() -> Tuple[Optional[str], Tuple[Any, ...]]:
    """The privates' presence and type, read once per process (again if :data:`PRIVATES` changes)."""
    global _read
    spec = tuple(PRIVATES.items())
    if _read[0] == spec:
        return _read[1], _read[2]
    reason, getters = None, []
    for module, attr, since in PRIVATES.values():
        present, value = _private(module, attr)
        if not present:
            if _CELERY >= since:
                reason = f"{module}.{attr} is missing from Celery {CELERY_VERSION} (the fast path reads it)"
                break
            continue
        get = getattr(value, "get", None)
        if not callable(get):
            reason = f"{module}.{attr} is not what the fast path expects (no get())"
            break
        getters.append((f"{module}.{attr}", get))
    _read = (spec, reason, tuple(getters))
    return reason, _read[2]


def blocker() -> Optional[str]:
    """Why this process's Celery cannot be replayed at all (None: it can).

    Called before each template is used, so the static part is read once. A private that this
    Celery should have and does not, or one that is not what we read it as, turns the fast path off."""
    reason, getters = _static()
    if reason is not None:
        return reason
    for name, get in getters:
        try:
            if get():
                return "a worker callback is being published (Celery retries that publish itself)"
        except Exception as exc:  # a different object under the same name
            return f"{name}.get() failed: {exc!r}"
    task_sent = getattr(signals, "task_sent", None)  # deprecated; Celery 6 drops it
    if task_sent is not None and getattr(task_sent, "receivers", None):
        return "receivers of the deprecated task_sent signal are connected"
    return None


def celerys(func: Any, module_file: str, name: str) -> bool:
    """*func* is Celery's own *name* from *module_file* (``celery/app/task.py``...), not a
    subclass's override nor a wrapper patched over it (Sentry, tracing libraries): a wrapper
    copies the name with ``functools.wraps``, never the code object."""
    code = getattr(getattr(func, "__func__", func), "__code__", None)
    return code is not None and code.co_name == name and \
        code.co_filename.replace(os.sep, "/").endswith("/celery/app/" + module_file)


def hook(app: Celery) -> bool:
    """Wrap the app's ``send_task_message`` once so a capture can stop there; False when it is
    not Celery's own (somebody else wraps it, and replaying would bypass them)."""
    amqp = app.amqp
    current = amqp.send_task_message
    if current is vars(amqp).get("_cluster_beat_hook"):
        return True  # ours, by identity: a functools.wraps wrapper over it copies its attributes
    if not celerys(current, "amqp.py", "send_task_message"):
        return False

    def send_task_message(producer, name, message, **options):
        if getattr(_capture, "active", False):
            _capture.result = _Captured(name, message, options)
            return None
        return current(producer, name, message, **options)

    send_task_message.__wrapped__ = current  # type: ignore[attr-defined]
    amqp.send_task_message = amqp._cluster_beat_hook = send_task_message
    return True


def celery_sender(app: Celery) -> Callable[..., Any]:
    """The app's own ``send_task_message`` (under our capture wrapper, once :func:`hook` ran)."""
    amqp = app.amqp
    current = amqp.send_task_message
    return current.__wrapped__ if current is vars(amqp).get("_cluster_beat_hook") else current


def capture_send(app: Celery, task_name: str, args, kwargs, options, headers, producer, *,
                 task_id: str = PLACEHOLDER, eta=None) -> Optional[_Captured]:
    """Run Celery's own send for this call, stopped before anything is published."""
    _capture.active, _capture.result = True, None
    try:
        options = {k: v for k, v in options.items() if k != "headers"}  # the call's headers come apart
        if eta is not None:
            options["eta"] = eta
        task = app.tasks.get(task_name)
        if task is not None:
            task.apply_async(args, kwargs, task_id=task_id, producer=producer, headers=dict(headers), **options)
        else:
            app.send_task(task_name, args, kwargs, task_id=task_id, producer=producer, headers=dict(headers),
                          **options)
        return _capture.result
    finally:
        _capture.active, _capture.result = False, None
        forget_result(app, task_id)


def forget_result(app: Celery, task_id: str) -> None:
    """``send_task`` told the result backend about a task id that is never sent (``on_task_call``:
    the Redis backend subscribes to its result channel); take that back."""
    consumer = getattr(app.backend, "result_consumer", None)
    cancel = getattr(consumer, "cancel_for", None)
    if cancel is not None:
        try:
            cancel(task_id)
        except Exception:  # nothing was subscribed, or the backend is unreachable: harmless
            logger.debug("cluster-beat: could not drop a result subscription", exc_info=True)


class _NoConnection:
    """What a recording producer offers as its connection (nothing to re-raise from)."""

    def _reraise_as_library_errors(self):
        return contextlib.nullcontext()


@dataclass
class Call:
    """One call made during a recorded send: positional and keyword arguments."""

    args: Tuple[Any, ...]
    kwargs: Dict[str, Any]


@dataclass
class Recording:
    """What one send did: the producer's ``publish`` call, the signals and the sent event."""

    publish: Optional[Call] = None
    before: Optional[Dict[str, Any]] = None
    after: Optional[Dict[str, Any]] = None
    event: Optional[Call] = None
    extra: List[str] = field(default_factory=list)  # anything else called on the producer or dispatcher


class RecordingProducer:
    """A producer that records ``publish`` instead of sending."""

    def __init__(self, recording: Recording) -> None:
        self._recording = recording
        self.connection = _NoConnection()

    def publish(self, body, **kwargs):
        if self._recording.publish is not None:
            self._recording.extra.append("publish (twice)")
        self._recording.publish = Call((body,), kwargs)

    def __getattr__(self, name):  # e.g. a retry loop reviving the connection: not replayable
        self._recording.extra.append(name)
        raise AttributeError(name)


class RecordingDispatcher:
    """An event dispatcher that records ``publish`` (the ``task-sent`` event)."""

    def __init__(self, recording: Recording) -> None:
        self._recording = recording

    def publish(self, *args, **kwargs):
        if self._recording.event is not None:
            self._recording.extra.append("event (twice)")
        self._recording.event = Call(args, dict(kwargs))


class SignalsUnreadable(RuntimeError):
    """Celery's signal dispatch is not what the recording relies on: the fast path is off."""


def _receiver_entry(func: Callable[..., Any]) -> Any:
    """A receivers-list entry for *func* in the form this Celery's Signal keeps (made by
    ``connect`` on a scratch signal, never by hand)."""
    scratch = Signal(name="cluster-beat-scratch")
    scratch.connect(func, weak=False)
    (entry,) = scratch.receivers
    return entry


def _noop(signal=None, sender=None, **named) -> None:
    """Listens while a send is recorded, so that a sender skipping signals nobody listens to
    (Celery < 5.7 tests the receivers list) still sends them; does nothing for anybody."""


@contextlib.contextmanager
def recording_signals(recording: Recording, *, mirror: bool = False):
    """Route ``before_task_publish`` / ``after_task_publish`` to recorders, on this thread only,
    for the duration of one recorded send.

    Other threads keep their receivers: each signal's ``_live_receivers`` (a Celery private,
    probed below before it is relied on) is shadowed on the instance by one that answers the
    recorder on this thread and the real receivers on any other; receivers connected or
    disconnected meanwhile stay so. *mirror*: record only where a receiver of this sender is
    connected (the send being checked must find the signals as a real one would)."""
    me = threading.get_ident()
    installed = []
    with _swap_lock:
        try:
            for sig, key in ((signals.before_task_publish, "before"), (signals.after_task_publish, "after")):
                original = getattr(sig, "_live_receivers", None)
                receivers = getattr(sig, "receivers", None)
                if not callable(original) or not isinstance(receivers, list) or "_live_receivers" in vars(sig):
                    raise SignalsUnreadable(f"{sig.name}: celery.utils.dispatch.Signal is not what the fast path "
                                            "reads (_live_receivers, receivers)")

                def record(signal=None, sender=None, _key=key, **named):
                    setattr(recording, _key, dict(named, sender=sender))

                def live(sender, *args, _original=original, _record=record, **kwargs):
                    if threading.get_ident() != me:
                        return _original(sender, *args, **kwargs)
                    if mirror and all(r is _noop for r in _original(sender, *args, **kwargs)):
                        return []
                    return [_record]

                entry = _receiver_entry(_noop)
                with sig.lock:
                    receivers.append(entry)
                installed.append((sig, entry))
                sig._live_receivers = live
                if not mirror:  # the probe: this thread's sends reach the recorder, and only it
                    sig.send(sender=PLACEHOLDER, cluster_beat_probe=True)
                    if (getattr(recording, key) or {}).get("cluster_beat_probe") is not True:
                        raise SignalsUnreadable(f"{sig.name}: a send on this thread did not reach the recorder")
                    setattr(recording, key, None)
            yield
        finally:
            for sig, entry in installed:
                vars(sig).pop("_live_receivers", None)
                with sig.lock:
                    for index, existing in enumerate(sig.receivers):
                        if existing is entry:
                            del sig.receivers[index]
                            break


def record_send(app: Celery, captured: _Captured, *,
                mirror: bool = False) -> Tuple[Recording, Dict[str, Any], Dict[str, Any]]:
    """Run the app's real ``send_task_message`` on copies of *captured* with recorders in place.

    Returns the recording and the headers and properties dicts the sender was given (it
    merges the call's headers and options into them in place, as every Celery 5 does)."""
    headers, properties, body, sent_event = captured.message
    headers, properties = dict(headers), dict(properties)
    sent_event = dict(sent_event) if sent_event is not None else None
    message = type(captured.message)(headers, properties, body, sent_event)
    recording = Recording()
    options = dict(captured.options)
    options["event_dispatcher"] = RecordingDispatcher(recording)
    with recording_signals(recording, mirror=mirror):
        celery_sender(app)(RecordingProducer(recording), captured.name, message, **options)
    return recording, headers, properties
