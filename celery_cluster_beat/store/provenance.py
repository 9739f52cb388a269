"""Whether a delivery's headers can be beat's: checked in the ledger's own transaction.

A run started by a forged delivery makes beat count the real occurrence as claimed elsewhere,
never sending it; refusing a real delivery loses its run (it is acknowledged, not run). So a
delivery is refused only when beat cannot have sent it:

* its instant is more than :data:`FUTURE_MARGIN` ahead of the database's clock **and no claim row
  exists** for it. Beat inserts its claim row before it publishes, so a message beat sent always
  finds one: a worker whose clock runs ahead of the database's running an ``eta`` message (jitter,
  a countdown) early by the database's time still runs it. Only a row-less future instant, which
  the ledger would insert and beat then find claimed, is refused.
* its schedule runs another task: a config entry's (the caller says, from its own config), or a
  stored schedule's, read from its row, tombstone included (a removed schedule's messages in
  flight still run), **when that row has not changed since** :data:`CHANGE_MARGIN` **before the
  instant**. A schedule's next
  occurrence is computed from its change's time, so an occurrence before the change is the old
  definition's: a backlog, an ``eta`` or retry countdown, a check-later copy or a redelivery of
  the task the schedule ran then. It runs, unchecked.

A schedule nobody names runs unchecked too: a config entry of beat's this worker's config lacks
(refusing would drop real runs in a rolling deploy), or a name no beat schedules, which cancels
nothing. The worker says so once per schedule (:func:`..worker.provenance.warn_unchecked`).
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Optional

import sqlalchemy as sa
from sqlalchemy.engine import Connection

from ..base import StrEnum
from .schema import claims_table, stored_schedules_table

#: How far a row-less delivery's instant may be ahead of the database's clock: beat claims up to
#: 0.5 s ahead (beat.duepass.CLAIM_AHEAD) and publishes at the instant by its estimate of that
#: clock; 1.5 s more for that estimate's error and a clock step.
FUTURE_MARGIN = timedelta(seconds=2.0)
#: A stored schedule changed this little before an instant may still have had it sent under the
#: old definition: beat claims up to 0.5 s ahead and reads a change within a second (a Redis
#: notice) or five (the change counter, when a notice is lost); the rest is room.
CHANGE_MARGIN = timedelta(seconds=10.0)


class Refusal(StrEnum):
    """Why the ledger refused a delivery (nothing was written on the claim row)."""

    FUTURE = "future"  # its instant is ahead of the database's clock by over FUTURE_MARGIN, and no claim row
    OTHER_TASK = "other-task"  # the schedule runs another task than the one delivered


class Unchecked(StrEnum):
    """Why a delivery's task could not be checked (it runs)."""

    UNKNOWN = "unknown"  # neither the caller's config nor a stored row names the schedule
    CHANGED = "changed"  # the stored schedule changed after the instant: the task may have changed since


@dataclass(frozen=True)
class Provenance:
    """What :func:`provenance` found: a refusal (with the schedule's task), or whether it went unchecked."""

    refusal: Optional[Refusal] = None
    schedule_task: Optional[str] = None
    unchecked: Optional[Unchecked] = None


def provenance(conn: Connection, schedule: str, at: datetime, now: datetime, task: Optional[str],
               schedule_task: Optional[str]) -> Provenance:
    """The checks of the module docstring for a delivery of *task* (None: no task check) for
    (*schedule*, *at*), *now* the database's time; *schedule_task* is the config entry's task."""
    if at > now + FUTURE_MARGIN:
        c = claims_table
        claimed = conn.execute(sa.select(c.c.schedule).where(c.c.schedule == schedule, c.c.scheduled_at == at)).first()
        if claimed is None:
            return Provenance(Refusal.FUTURE)
    if task is None:
        return Provenance()
    expected = schedule_task
    if expected is None:
        s = stored_schedules_table
        row = conn.execute(sa.select(s.c.task, s.c.changed_at).where(s.c.name == schedule)).first()
        if row is None:
            return Provenance(unchecked=Unchecked.UNKNOWN)
        if row.changed_at > at - CHANGE_MARGIN:
            return Provenance(unchecked=Unchecked.CHANGED)
        expected = row.task
    if expected != task:
        return Provenance(Refusal.OTHER_TASK, schedule_task=expected)
    return Provenance()


__all__ = ["CHANGE_MARGIN", "FUTURE_MARGIN", "Provenance", "Refusal", "Unchecked", "provenance"]
