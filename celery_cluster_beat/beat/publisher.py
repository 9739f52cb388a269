"""Sending claimed occurrences with Celery's message format, signals and routing.

Each entry's message is built once by Celery's own ``send_task`` and then
stamped per occurrence (:mod:`..messages`): the wire format, the routing and the
``before_task_publish`` / ``after_task_publish`` signals are exactly those of a
normal send, without repeating Celery's per-call work thousands of times a
burst. What cannot be replayed exactly goes through ``apply_async`` /
``send_task`` message by message, as before. What we add is the transport batch
(kombu's ``Producer.batch()``: on Redis one pipelined round trip per chunk
instead of one per message) and a producer held from the pool for the whole
burst instead of one acquire per message.

A message goes out only while its row is known to be this node's
(:class:`Ownership`): between two messages, and before a batch is flushed, the
publisher looks at the monotonic clock, and when the chunk's confirmation has
grown older than its validity (the process was paused: GC, a frozen VM,
SIGSTOP) the rows not yet out are confirmed again, and those taken over
meanwhile are withheld (:class:`Withheld`), buffered ones included.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from .. import faults
from ..messages import TemplateBroken, Templates
from ..schedules.occurrence import Occurrence
from .sendwatch import SendWatch
from ..worker.protocol import beat_headers

logger = logging.getLogger("celery_cluster_beat.publisher")

CHUNK = 500


class Withheld(Exception):
    """Not published on purpose: the row is no longer known to be this node's (taken over while
    the chunk was being published, or its confirmation failed: see :attr:`Ownership.error`).
    Nothing about it is recorded by the sender; the row's owner sends it."""


@dataclass
class Ownership:
    """The rows of one publish, confirmed as this node's at monotonic *confirmed_at*; valid for
    *max_age* seconds, since no row can be taken over before it is older than the grace.

    *confirm* takes the occurrences not yet out and returns those still ours and the monotonic
    time read just before it asked; it may raise (the store cannot answer, this node was fenced
    out): the error is kept in :attr:`error` and nothing more is published.
    """

    confirmed_at: float
    max_age: float
    confirm: Callable[[List[Occurrence]], Tuple[Set[Occurrence], float]]
    error: Optional[BaseException] = None

    def stale(self) -> bool:
        return self.error is not None or time.monotonic() - self.confirmed_at > self.max_age

    def still_ours(self, occurrences: List[Occurrence]) -> Set[Occurrence]:
        """Those of *occurrences* still ours, confirmed now (none once a confirmation failed)."""
        if self.error is not None or not occurrences:
            return set()
        try:
            mine, self.confirmed_at = self.confirm(occurrences)
        except Exception as exc:  # the caller raises it once what went out is recorded
            self.error = exc
            return set()
        return mine


class _Redo(Exception):
    """A buffered message's row was taken over: the batch is dropped, the rest built again."""


def _buffering(ctx: Any) -> Optional[bool]:
    """Whether the kombu batch *ctx* holds its messages until the flush (True) or sent each at
    once (False), once a message went through it; None when this kombu does not say.

    kombu keeps this in private attributes (``_ProducerBatch.state``); when they are missing or
    different the caller stops batching (see :meth:`Publisher._publish_chunk`).
    """
    state = getattr(ctx, "state", None)
    immediate = getattr(state, "immediate", None)
    if not isinstance(immediate, bool) or not hasattr(state, "session"):
        return None
    return not immediate and state.session is not None


@dataclass
class Dispatch:
    """One message to send: which occurrence, which task, with what."""

    occurrence: Occurrence
    task: str
    args: tuple = ()
    kwargs: Dict[str, Any] = field(default_factory=dict)
    options: Dict[str, Any] = field(default_factory=dict)
    #: Sent as a catch-up after downtime (header ``cluster_beat_catchup``).
    catchup: bool = False
    #: Sent by an operator's backfill (header ``cluster_beat_backfill``).
    backfill: bool = False
    #: Which publish attempt this is (header ``cluster_beat_attempt``).
    attempt: int = 1
    #: The entry's effective max_run_time, for the worker's ledger (header ``cluster_beat_max_run_time``).
    max_run_time: Optional[float] = None
    #: When the message may run (jitter); None: at once. Kept out of *options*, which stay the entry's
    #: own object so that its prebuilt message is recognised.
    eta: Optional[datetime] = None


class Publisher:
    """Sends batches of dispatches; reports a per-dispatch error instead of raising."""

    def __init__(self, app, node_id: str) -> None:
        self.app = app
        self.node_id = node_id
        #: (task, queue option) pairs whose queue was declared during the current publish() call.
        self._declared: set = set()
        #: Each entry's message, built once by Celery and stamped per occurrence.
        self.templates = Templates(app)
        #: Messages sent from a template / through Celery's per-message path (for metrics and tests).
        self.stamped = self.celery_path = 0
        #: Whether sends go through at all (``/healthz`` fails while none does).
        self.watch = SendWatch()
        self._backend = None

    def warm_up(self) -> None:
        """Open the broker connection now, so the first burst does not pay for it."""
        try:
            with self.app.producer_or_acquire() as producer:
                producer.connection.default_channel
        except Exception as exc:  # the broker may be down at start; sends will retry
            logger.warning("cluster-beat: cannot connect to the broker yet: %r", exc)

    def _headers(self, d: Dispatch) -> tuple:
        """The headers the message carries (the entry's own, then ours) and ours alone."""
        headers = dict(d.options.get("headers") or {})
        dynamic = beat_headers(d.occurrence.schedule, d.occurrence.at, self.node_id, catchup=d.catchup,
                               attempt=d.attempt, max_run_time=d.max_run_time, backfill=d.backfill)
        headers.update(dynamic)
        return headers, dynamic

    def prepare(self, d: Dispatch) -> bool:
        """Build the message template of *d*'s entry ahead of its fire; False: it is sent
        through Celery's per-message path (or building it failed: the send will say why)."""
        headers, _ = self._headers(d)
        return self.templates.get(d.occurrence.schedule, d.task, d.args, d.kwargs, d.options, headers, None,
                                  eta=False) is not None

    def _send_one(self, d: Dispatch, producer) -> None:
        options = d.options  # never mutated: Celery's beat mutates entry.options['headers']; we do not
        first = True
        if "declare" not in options and "exchange" not in options and "routing_key" not in options:
            # Celery re-checks the queue's declaration on every message; once per queue per
            # burst is enough (the first message of each declares it as Celery would).
            route = (d.task, str(options.get("queue")))
            first = route not in self._declared
            self._declared.add(route)
        headers, dynamic = self._headers(d)
        try:
            template = self.templates.get(d.occurrence.schedule, d.task, d.args, d.kwargs, options, headers,
                                          producer, eta=d.eta is not None)
        except Exception as exc:  # the fast path's own failure must never cost the send
            template = None
            self.templates.refuse(d.occurrence.schedule, (d.task, d.args, d.kwargs, options, tuple(headers)),
                                  f"deciding on its prebuilt message failed ({exc!r})", warn=True)
        if template is not None:
            if self._backend is None:
                self._backend = self.app.backend
            try:
                template.send(self.app, producer, d.occurrence.task_id, d.eta, dynamic, declare=first,
                              backend=self._backend)
            except TemplateBroken as exc:  # nothing went out: Celery's own path sends it, now and from now on
                # (after a before_task_publish that fired already, receivers see this send twice: rare,
                # as what kombu refuses is looked for before the signal)
                self.templates.refuse(d.occurrence.schedule, template.source,
                                      f"replaying its prebuilt message failed ({exc})", warn=True)
            else:
                self.stamped += 1
                return
        self.celery_path += 1
        options = {k: v for k, v in options.items() if k != "headers"}
        if not first:
            options["declare"] = []
        if d.eta is not None:
            options["eta"] = d.eta
        task = self.app.tasks.get(d.task)
        if task is not None:
            task.apply_async(d.args, d.kwargs, task_id=d.occurrence.task_id, producer=producer, headers=headers, **options)
        else:  # not registered here: send by name, as Celery's beat does
            self.app.send_task(
                d.task, d.args, d.kwargs, task_id=d.occurrence.task_id, producer=producer, headers=headers, **options
            )

    def publish(self, dispatches: Sequence[Dispatch],
                ownership: Optional[Ownership] = None) -> List[Optional[BaseException]]:
        """Send all (those still ours: see :class:`Ownership`); the result lists, per dispatch,
        None (sent) or the error (:class:`Withheld`: not published on purpose)."""
        errors: List[Optional[BaseException]] = [None] * len(dispatches)
        self._declared = set()
        self._backend = None  # read once per publish (Celery keeps it per thread)
        sent = [False] * len(dispatches)
        if not dispatches:
            return errors
        failure: Optional[BaseException] = None
        try:
            with self.app.producer_or_acquire() as producer:
                for start in range(0, len(dispatches), CHUNK):
                    chunk = range(start, min(start + CHUNK, len(dispatches)))
                    self._publish_chunk(dispatches, chunk, producer, errors, sent, ownership)
        except Exception as exc:  # no producer/connection: nothing of what is left went out
            logger.error("cluster-beat: cannot reach the broker: %r", exc)
            failure = exc
        for i, ok in enumerate(sent):
            if not ok and errors[i] is None:
                errors[i] = failure or RuntimeError("not sent")
        self.watch.record([err for err in errors if not isinstance(err, Withheld)])
        return errors

    def _recheck(self, dispatches, ownership: Optional[Ownership], indices: List[int], errors) -> List[int]:
        """If the confirmation is too old: those of *indices* still ours (the others withheld)."""
        if ownership is None or not indices or not ownership.stale():
            return indices
        mine = ownership.still_ours([dispatches[i].occurrence for i in indices])
        for i in indices:
            if dispatches[i].occurrence not in mine:
                errors[i] = Withheld(f"not published: {ownership.error!r}" if ownership.error is not None
                                     else "taken over by another node while this node was held up")
        return [i for i in indices if dispatches[i].occurrence in mine]

    def _publish_each(self, dispatches, todo: List[int], producer, errors, sent,
                      ownership: Optional[Ownership]) -> None:
        """One publish per message, each out at once."""
        for n, i in enumerate(todo):
            if n:
                faults.hit("mid-chunk")
            if errors[i] is not None or not self._recheck(dispatches, ownership, [i], errors):
                continue
            sent[i] = self._send_guarded(dispatches[i], producer, errors, i)

    def _publish_chunk(self, dispatches, chunk: range, producer, errors, sent,
                       ownership: Optional[Ownership] = None) -> None:
        batch = getattr(producer, "batch", None)
        todo = list(chunk)
        while todo and batch is not None:
            try:
                todo = self._publish_batch(batch, dispatches, todo, producer, errors, sent, ownership)
            except _Redo as redo:  # dropped unflushed: what is still ours is built again
                todo = redo.args[0]
            except Exception as exc:  # the flush failed: none of the buffered messages is known to be out
                logger.error("cluster-beat: publishing %d messages failed: %r", len(todo), exc)
                for i in todo:
                    if errors[i] is None:
                        errors[i] = exc
                return
            else:
                break  # all through the batch, or the rest goes one by one
        if todo:  # kombu < 5.7, or a batch that does not say whether it buffers: one publish per message
            self._publish_each(dispatches, todo, producer, errors, sent, ownership)

    def _publish_batch(self, batch, dispatches, todo: List[int], producer, errors, sent,
                       ownership: Optional[Ownership]) -> List[int]:
        """Publish *todo* in one kombu batch; what is left to publish one by one (the batch could
        not say whether it holds messages back). Raises _Redo when a buffered row was lost."""
        out: List[int] = []  # through the batch: buffered until the flush, or out already
        buffering: Optional[bool] = None
        rest: List[int] = []
        with batch(max_size=len(todo) * 4 + 16) as ctx:
            queue = list(todo)
            while queue:
                if out:
                    faults.hit("mid-chunk")
                if ownership is not None and ownership.stale():
                    held = out if buffering else []
                    kept = set(self._recheck(dispatches, ownership, held + queue, errors))
                    if any(i not in kept for i in held):  # a lost row is in the buffer: drop it all
                        raise _Redo([i for i in held + queue if i in kept])
                    queue = [i for i in queue if i in kept]
                    if not queue:
                        break
                i = queue.pop(0)
                if self._send_guarded(dispatches[i], producer, errors, i):
                    out.append(i)
                if buffering is None and out:
                    buffering = _buffering(ctx)
                    if buffering is None:  # cannot tell: flush what went in, go on one by one
                        rest = queue
                        break
            if buffering and ownership is not None and ownership.stale():  # held up before the flush
                kept = set(self._recheck(dispatches, ownership, list(out), errors))
                if any(i not in kept for i in out):
                    raise _Redo([i for i in out if i in kept])
        for i in out:  # flushed
            sent[i] = True
        return rest

    def _send_guarded(self, d: Dispatch, producer, errors, i: int) -> bool:
        try:
            self._send_one(d, producer)
        except Exception as exc:  # serialisation, routing, connection: this one failed
            logger.error("cluster-beat: sending %s for %s failed: %r", d.task, d.occurrence.schedule, exc)
            errors[i] = exc
            return False
        return True
