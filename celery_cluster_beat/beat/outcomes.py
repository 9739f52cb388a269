"""What happened to an occurrence, said once: in the log and through ``occurrence_handled``.

Every path of the send pipeline reports through :class:`Reporter`, so an
operator's log and a signal receiver (metrics, events) always agree.
"""
from __future__ import annotations

import logging
from typing import Any, Optional

from .. import signals
from ..base import StrEnum
from ..config import Entry
from ..config.values import printable
from ..schedules.occurrence import Occurrence

logger = logging.getLogger("celery_cluster_beat")


class Outcome(StrEnum):
    """The outcomes ``occurrence_handled`` reports (members equal their string values)."""

    SENT = "sent"
    RESENT = "resent"  # sent again with the same task id after its claimant stopped
    BACKFILLED = "backfilled"  # a past occurrence sent by an operator's backfill (reason ``backfill``)
    SKIPPED_OVERLAP = "skipped-overlap"
    BUFFERED = "buffered"
    REPLACED = "replaced"
    MISSED = "missed"
    CLAIM_LOST = "claim-lost"
    FAILED = "failed"


class Reporter:
    """Logs an outcome the way operators read beat's log, then sends the signal."""

    def __init__(self, sender: Any) -> None:
        self.sender = sender

    def __call__(self, outcome: Outcome, occ: Occurrence, reason: Optional[str] = None,
                 entry: Optional[Entry] = None, *, log: bool = True) -> None:
        if log:  # names as operators read them: a stored name's bidi or control characters escaped
            if entry is not None and outcome in (Outcome.SENT, Outcome.RESENT, Outcome.BACKFILLED):
                # Celery's own beat line, so existing log searches keep working.
                logger.info("Scheduler: Sending due task %s (%s) for %s%s", printable(entry.name),
                            printable(entry.task), occ.at.isoformat(),
                            " (resent)" if outcome is Outcome.RESENT else
                            " (backfill)" if outcome is Outcome.BACKFILLED else "")
            elif outcome is Outcome.CLAIM_LOST:
                logger.debug("cluster-beat: %s at %s was claimed by another node", printable(occ.schedule),
                             occ.at.isoformat())
            else:
                logger.info("cluster-beat: %s at %s: %s%s", printable(occ.schedule), occ.at.isoformat(), outcome,
                            f" ({printable(reason)})" if reason else "")
        signals.occurrence_handled.send(sender=self.sender, outcome=outcome, schedule=occ.schedule,
                                        scheduled_at=occ.at, task_id=occ.task_id, reason=reason)
