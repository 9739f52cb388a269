"""Which call of a ledger task is the delivery: only the call Celery's tracer makes goes through the ledger.

A ledger task called as a function (``my_task(...)``) runs in the caller's thread with
no message of its own. Inside a run it still sees a delivery's request: calling itself
(recursion), its ``self.request`` is the outer delivery's (Celery 5.7's ``Task.__call__``
even pushes a copy of it, ``called_directly`` false, same id and headers); and where
tasks share one request stack, another task's request. Judged from the request alone,
such a call is a second delivery of the outer occurrence: refused with ``Ignore``,
which aborts the outer body while its row says ``succeeded``.

So the delivery is recognised by the tracer's call itself: Celery's tracer pushes a
fresh request for each delivery and then calls the task once; the ledger marks that
request when its ``__call__`` is entered. A call that finds its request already
marked (or a copy of a marked one) is a call made inside that run; a call whose
request names another task, or says ``called_directly``, is a direct call too. The
mark's value is an object of this module, so no message header can forge or clear it.
"""
from __future__ import annotations

from typing import Any

#: The request attribute that marks a request whose delivery the ledger has entered.
MARK = "_cluster_beat_delivery"


class _Entered(str):
    """The mark's value: compared by identity, so a header of the same name means nothing. A
    string, because Celery 5.7 may copy the request's attributes into the headers of a message
    sent from inside the run (a retry from a direct call): it must serialize, and its copy in
    that message is not this object, so it marks nothing there."""

    __slots__ = ()


ENTERED = _Entered("entered")


def enters_delivery(task: Any, request: Any) -> bool:
    """True exactly once per delivery: for the call the tracer made for *request*; then marks it.

    False for a direct call, inside a run or not: ``called_directly``, a request of another
    task, or one whose delivery was already entered (recursion, a nested direct call).
    """
    if request is None or getattr(request, "called_directly", True):
        return False
    if getattr(request, MARK, None) is ENTERED:
        return False
    named = getattr(request, "task", None)
    if isinstance(named, str) and named and named != task.name:
        return False  # another task's request seen through a shared stack: not this task's delivery
    try:
        setattr(request, MARK, ENTERED)
    except (AttributeError, TypeError):  # a request that takes no mark: judged by the request, as before
        pass
    return True


__all__ = ["ENTERED", "MARK", "enters_delivery"]
