"""What to do with occurrences that fell due while nobody could send them.

Pure: a schedule, the last handled instant and "now" in; which instants to
send and which to record as missed out. Used after a failover, a restart or
any stall of the loop, so every path through the scheduler applies one policy.

* ``latest`` (default): the most recent due occurrence is sent once;
* ``all``: each due occurrence, oldest first, at most ``max_count``;
* ``none``: only an occurrence that is on time (due within ``ON_TIME``).

Occurrences older than ``window`` seconds are never sent. Everything not sent
is reported as missed (up to ``record_limit`` of them, so two weeks of an
every-second schedule do not turn into a million rows).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import List, Optional

from ..config.values import CatchupPolicy
from ..schedules.instants import TINY

#: Missed occurrences recorded per schedule and pass, at most.
RECORD_LIMIT = 1000
#: A due occurrence handled within this delay is "on time", not catch-up.
ON_TIME = timedelta(seconds=2)


@dataclass
class CatchupPlan:
    send: List[datetime] = field(default_factory=list)
    missed: List[datetime] = field(default_factory=list)
    missed_truncated: bool = False


def recent_fires(schedule, since: datetime, now: datetime, count: int) -> List[datetime]:
    """The latest *count* fire instants in (since, now], oldest first.

    Searches backwards from *now* with a doubling look-back, so the cost
    depends on *count*, not on how long the schedule went unattended.
    """
    span = timedelta(minutes=1)
    while True:
        start = max(since, now - span)
        fires = schedule.fires_between(start, now)
        if len(fires) >= count or start == since:
            return fires[-count:]
        span *= 2


def plan_catchup(
    schedule,
    since: datetime,
    now: datetime,
    *,
    policy: CatchupPolicy,
    window: Optional[float],
    max_count: int,
    record_limit: int = RECORD_LIMIT,
) -> CatchupPlan:
    """Split the occurrences in (since, now] into those to send and those missed."""
    plan = CatchupPlan()
    first = schedule.next_fire(since)
    if first > now:
        return plan
    oldest_allowed = since if window is None else max(since, now - timedelta(seconds=window))
    if policy == CatchupPolicy.ALL:
        send = recent_fires(schedule, oldest_allowed, now, max_count)
    else:
        send = recent_fires(schedule, oldest_allowed, now, 1)
        if policy == CatchupPolicy.NONE and send and now - send[-1] > ON_TIME:
            send = []
    plan.send = send
    stop = send[0] if send else now + TINY
    missed = schedule.fires_between(since, stop - TINY, limit=record_limit + 1)
    if len(missed) > record_limit:
        missed = missed[:record_limit]
        plan.missed_truncated = True
    plan.missed = missed
    return plan
