"""The templates of one beat process: built when first needed, proven per shape, refused for good.

:meth:`Templates.get` answers, per message, whether the entry's prebuilt message
(:mod:`.messages`) may be used or the message goes through Celery's own path. It
builds a missing or stale template, runs the self-check (:mod:`.selfcheck`) the
first time a shape of message is seen, and remembers refusals, so that the log
says once per reason why entries take Celery's path, never once per message.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Dict, Optional, Tuple

from celery.app.base import Celery

from . import celerysend, selfcheck
from .template import Template, build, why_not

logger = logging.getLogger("celery_cluster_beat.publisher")

#: Templates kept; the oldest built are dropped beyond it (rebuilt at their next fire).
MAX_TEMPLATES = 50_000


def _same(a: Tuple[Any, ...], b: Tuple[Any, ...]) -> bool:
    """Built from the same entry: same task name and header names, the very same args, kwargs
    and options objects (an equal copy may differ in type: (1,) == (True,))."""
    return a[0] == b[0] and a[4] == b[4] and all(x is y for x, y in zip(a[1:4], b[1:4]))


class Templates:
    """The templates of one beat process, by schedule name, built when first needed."""

    def __init__(self, app: Celery) -> None:
        self.app = app
        self._by_name: Dict[str, Template] = {}
        #: Entries that must take Celery's path, with the source they were judged on.
        self._refused: Dict[str, Tuple[Any, ...]] = {}
        #: Shapes checked in this process: None when they passed, else the field that differed.
        self.shapes: Dict[Tuple[Any, ...], Optional[str]] = {}
        self._told: set = set()
        #: Why each refused entry takes Celery's path (for ``check``; bounded with the refusals).
        self.reasons: Dict[str, str] = {}

    def __len__(self) -> int:
        return len(self._by_name)

    def has(self, name: str) -> bool:
        """A template or a refusal is held for *name* (it need not be prepared again)."""
        return name in self._by_name or name in self._refused

    def kept(self) -> int:
        """How many entries have a template or a refusal kept (what :meth:`__len__` counts, plus refusals)."""
        return len(self._by_name.keys() | self._refused.keys())

    def forget(self, name: str) -> None:
        """Drop the template or refusal of *name* (its schedule is no longer held): built, or judged,
        again when it is sent next."""
        self._by_name.pop(name, None)
        self._refused.pop(name, None)
        self.reasons.pop(name, None)

    def retain(self, keep: Callable[[str], bool]) -> None:
        """Keep the templates and refusals only of the entries *keep* says are held."""
        for name in [n for n in self._by_name if not keep(n)] + [n for n in self._refused if not keep(n)]:
            self.forget(name)

    def get(self, name: str, task: str, args, kwargs, options: Dict[str, Any], headers: Dict[str, Any],
            producer, *, eta: bool) -> Optional[Template]:
        """The template for this entry as it is now, built if missing or stale; None: send it
        through Celery's own path."""
        blocked = celerysend.blocker()
        if blocked is not None:
            self._tell(name, blocked, warn=True)
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
                    self.refuse(name, source, reason)
                return None
            self._refused.pop(name, None)
            self.reasons.pop(name, None)
            if len(self._by_name) >= MAX_TEMPLATES:
                self._by_name.pop(next(iter(self._by_name)))
            self._by_name[name] = tpl
        if eta and not tpl.eta_ok:
            return None
        return tpl

    def refuse(self, name: str, source: Tuple[Any, ...], reason: str, *, warn: bool = False) -> None:
        """Send *name* through Celery's own path until its entry changes."""
        self._by_name.pop(name, None)
        if len(self._refused) >= MAX_TEMPLATES:
            oldest = next(iter(self._refused))
            del self._refused[oldest]
            self.reasons.pop(oldest, None)
        self._refused[name] = source
        self.reasons[name] = reason
        self._tell(name, reason, warn=warn)

    def _tell(self, name: str, reason: str, *, warn: bool = False) -> None:
        """Say once per reason that entries take Celery's per-message path; each entry at DEBUG.
        A Celery the fast path does not match (*warn*) is worth a WARNING; a choice of the
        entry's (a router function, a countdown) an INFO."""
        if reason not in self._told:
            self._told.add(reason)
            logger.log(logging.WARNING if warn else logging.INFO,
                       "cluster-beat: %s and other entries for the same reason are sent through Celery's "
                       "per-message path: %s", name, reason)
        logger.debug("cluster-beat: %s is sent through Celery's per-message path: %s", name, reason)

    def _build(self, name, source, task, args, kwargs, options, headers,
               producer) -> Tuple[Optional[Template], Optional[str]]:
        """The template, or None and why it cannot be made (None: it failed this time, as the
        send through Celery's path will show)."""
        app = self.app
        try:
            reason = why_not(app, task, options)
            if reason is not None:
                return None, reason
            captured = celerysend.capture_send(app, task, args, kwargs, options, headers, producer)
            if captured is None:
                return None, "send_task did not reach send_task_message"
            tpl, reason = build(app, source, captured)
            if tpl is None:
                return None, reason
            tpl.shape = selfcheck.shape_of(app, tpl, options, headers)
        except celerysend.SignalsUnreadable as exc:
            return None, str(exc)
        except Exception as exc:  # the same error comes back from Celery's path, per message
            logger.debug("cluster-beat: %s: building its message failed (%r)", name, exc)
            return None, None
        if tpl.shape not in self.shapes:
            self.shapes[tpl.shape] = selfcheck.verify(app, tpl, task, args, kwargs, options, headers, producer)
            if self.shapes[tpl.shape] is not None:
                logger.warning("cluster-beat: %s: its prebuilt message differs from what Celery %s sends in %s; "
                               "entries like it are sent through Celery's own path",
                               name, celerysend.CELERY_VERSION, self.shapes[tpl.shape])
        difference = self.shapes[tpl.shape]
        if difference is not None:
            reason = f"its prebuilt message differs from Celery's in {difference}"
            self._told.add(reason)  # the warning above said it
            return None, reason
        return tpl, None
