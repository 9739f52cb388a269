"""Build an entry's message without sending it: can it be sent at all, and by which path?

``cluster-beat check`` runs this for every entry so that a schedule whose message
cannot be built (arguments the serializer refuses, a queue that is not declared, a
Celery whose fast path is off) is found before beat starts sending nothing for it.
Celery's own path is always tried (it is the fallback of every send); the fast path
then says whether it serves the entry, and if not, why.
"""
from __future__ import annotations

import enum
import uuid
from dataclasses import dataclass
from typing import Any, Dict, Optional

from celery.app.base import Celery
from kombu.serialization import dumps

from . import celerysend
from .template import why_not
from .templates import Templates


class SendPath(str, enum.Enum):
    """How beat would send an entry's messages."""

    #: Prebuilt once, stamped per occurrence.
    TEMPLATE = "template"
    #: Celery's own ``apply_async`` / ``send_task`` per message.
    CELERY = "celery"
    #: Neither: every send of it fails.
    UNSENDABLE = "unsendable"


@dataclass(frozen=True)
class DryRun:
    name: str
    path: SendPath
    #: Why Celery's path (CELERY), what fails (UNSENDABLE); None for TEMPLATE.
    detail: Optional[str] = None


def dry_run(app: Celery, templates: Templates, name: str, task: str, args, kwargs, options: Dict[str, Any],
            headers: Dict[str, Any]) -> DryRun:
    """Build *name*'s message both ways, publishing nothing and firing no receiver of the app's."""
    if app.conf.task_always_eager:  # apply_async would run the task here and now
        return DryRun(name, SendPath.CELERY, "task_always_eager is set (tasks run where they are sent; "
                                             "nothing is built or checked)")
    reason = why_not(app, task, options)
    if not celerysend.hook(app) or (reason is not None and "overridden or wrapped" in reason):
        # Its send runs code of the application's per call: only a real send can tell.
        return DryRun(name, SendPath.CELERY, f"{reason or 'send_task_message is wrapped'}; built per send, "
                                             "not checked here")
    blocked = celerysend.blocker()
    task_id = f"cluster-beat-check-{uuid.uuid4()}"
    try:
        captured = celerysend.capture_send(app, task, args, kwargs, options, headers, None, task_id=task_id)
        if captured is None:
            return DryRun(name, SendPath.UNSENDABLE, "Celery's send did not reach send_task_message")
        if blocked is None:  # routing and declarations too: Celery's sender runs with recorders
            recording, _, _ = celerysend.record_send(app, captured, mirror=True)
            if recording.publish is None:
                return DryRun(name, SendPath.UNSENDABLE, "Celery's send published nothing")
            dumps(recording.publish.args[0], serializer=recording.publish.kwargs.get("serializer"))
        else:  # the sender would fire task_sent receivers (or cannot be read): the body alone
            dumps(captured.message[2], serializer=captured.options.get("serializer") or app.conf.task_serializer)
    except Exception as exc:  # what every send of this entry would fail with
        return DryRun(name, SendPath.UNSENDABLE, f"{type(exc).__name__}: {exc}"[:500])
    if reason is not None:
        return DryRun(name, SendPath.CELERY, reason)
    if blocked is not None:
        return DryRun(name, SendPath.CELERY, blocked)
    if templates.get(name, task, args, kwargs, options, headers, None, eta=False) is None:
        return DryRun(name, SendPath.CELERY, templates.reasons.get(name, "building its template failed"))
    return DryRun(name, SendPath.TEMPLATE)
