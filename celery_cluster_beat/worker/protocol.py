"""What a message from beat says about its occurrence: the header names and their parsing.

Beat's publisher writes these headers on every message; the ledger task and the
task body read them back as an :class:`OccurrenceContext`. Header values are
JSON types (strings, numbers, booleans) so any serializer carries them.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any, Dict, Optional

from ..schedules.instants import UTC, utc_iso

#: The schedule entry's name.
HEADER_SCHEDULE = "cluster_beat_schedule"
#: The occurrence's nominal instant, ISO 8601 UTC (the jitter and the send time do not move it).
HEADER_SCHEDULED_AT = "cluster_beat_scheduled_at"
#: The beat node that sent the message (``cluster_beat_node_id``).
HEADER_NODE = "cluster_beat_node"
#: True when the occurrence was sent as a catch-up after downtime, not on time.
HEADER_CATCHUP = "cluster_beat_catchup"
#: True on an occurrence sent by an operator's backfill (``cluster-beat backfill``); absent otherwise.
HEADER_BACKFILL = "cluster_beat_backfill"
#: Which publish attempt of the occurrence this message is (1, or more after failed publishes).
HEADER_ATTEMPT = "cluster_beat_attempt"
#: The entry's effective ``max_run_time`` (seconds): after it a redelivered acks_late run may run again.
HEADER_MAX_RUN_TIME = "cluster_beat_max_run_time"

#: On a "check later" copy the ledger published itself (acks_late, the run found alive): the
#: copy's id, matched against the one pending on the run's row. Never written by beat.
HEADER_CHECK = "cluster_beat_check"

HEADERS = (HEADER_SCHEDULE, HEADER_SCHEDULED_AT, HEADER_NODE, HEADER_CATCHUP, HEADER_ATTEMPT, HEADER_MAX_RUN_TIME,
           HEADER_BACKFILL)


def beat_headers(schedule: str, at: datetime, node: str, *, catchup: bool = False, attempt: int = 1,
                 max_run_time: Optional[float] = None, backfill: bool = False) -> Dict[str, Any]:
    """The headers beat adds to an occurrence's message, in the order it writes them (Celery's
    own ``celery_beat_task`` marker included: tools that tell beat's messages apart read it).
    ``cluster_beat_backfill`` is written only on a backfill's messages (so every other message,
    and its prebuilt template, stays as it was)."""
    headers: Dict[str, Any] = {
        HEADER_SCHEDULE: schedule,
        HEADER_SCHEDULED_AT: utc_iso(at),
        HEADER_NODE: node,
        HEADER_CATCHUP: catchup,
        HEADER_ATTEMPT: attempt,
        "celery_beat_task": True,
    }
    if max_run_time is not None:
        headers[HEADER_MAX_RUN_TIME] = max_run_time
    if backfill:
        headers[HEADER_BACKFILL] = True
    return headers


class ProtocolError(ValueError):
    """A message carries ``cluster_beat_*`` headers that do not parse (not written by our beat)."""


def parse_instant(text: Any) -> datetime:
    """The aware UTC instant of a ``cluster_beat_scheduled_at`` value."""
    if not isinstance(text, str):
        raise ProtocolError(f"{HEADER_SCHEDULED_AT}: expected an ISO 8601 string, got {type(text).__name__}")
    try:
        value = datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ProtocolError(f"{HEADER_SCHEDULED_AT}: not an ISO 8601 instant: {text[:60]!r}") from None
    if value.tzinfo is None:
        raise ProtocolError(f"{HEADER_SCHEDULED_AT}: no UTC offset in {text[:60]!r}")
    return value.astimezone(UTC)


@dataclass(frozen=True)
class OccurrenceContext:
    """The occurrence a task run serves, as the task body reads it (``self.occurrence``,
    :func:`~celery_cluster_beat.worker.current_occurrence`)."""

    #: The beat_schedule entry's name.
    schedule: str
    #: The nominal instant of the occurrence, aware UTC.
    scheduled_at: datetime
    #: The beat node that sent it (None when the header is missing).
    node: Optional[str]
    #: Sent as a catch-up after downtime, not on time.
    catchup: bool
    #: Which run attempt this is: 1, then 2, 3 ... for Celery retries (``request.retries + 1``).
    attempt: int
    #: Which publish attempt of beat the message came from (1 unless publishing failed first).
    send_attempt: int
    #: The Celery task id (the same for every delivery and retry of the occurrence).
    task_id: str
    #: The entry's effective max_run_time in seconds, as beat sent it (None: not sent).
    max_run_time: Optional[float]
    #: Sent by an operator's backfill (``cluster-beat backfill``), not by the schedule's own fire.
    backfill: bool = False

    @classmethod
    def from_request(cls, request: Any) -> Optional["OccurrenceContext"]:
        """The occurrence of a Celery task *request*; None when it carries no ``cluster_beat_*``
        headers (the task was not sent by beat). ProtocolError when the headers do not parse."""
        get = request.get if hasattr(request, "get") else (lambda k, d=None: getattr(request, k, d))
        schedule = get(HEADER_SCHEDULE)
        raw_at = get(HEADER_SCHEDULED_AT)
        if schedule is None and raw_at is None:
            headers = get("headers") or {}
            if isinstance(headers, dict):  # eager apply() keeps them apart
                get = headers.get
                schedule, raw_at = get(HEADER_SCHEDULE), get(HEADER_SCHEDULED_AT)
        if schedule is None and raw_at is None:
            return None
        if not isinstance(schedule, str) or not schedule:
            raise ProtocolError(f"{HEADER_SCHEDULE}: expected a schedule name, got {schedule!r}"[:200])
        at = parse_instant(raw_at)
        node = get(HEADER_NODE)
        max_run_time = get(HEADER_MAX_RUN_TIME)
        try:
            max_run_time = None if max_run_time is None else float(max_run_time)
            send_attempt = int(get(HEADER_ATTEMPT) or 1)
        except (TypeError, ValueError):
            raise ProtocolError(f"{HEADER_MAX_RUN_TIME} / {HEADER_ATTEMPT}: not a number") from None
        retries = getattr(request, "retries", None) or 0
        return cls(
            schedule=schedule,
            scheduled_at=at,
            node=node if isinstance(node, str) else None,
            catchup=bool(get(HEADER_CATCHUP) or False),
            attempt=int(retries) + 1,
            send_attempt=send_attempt,
            task_id=str(getattr(request, "id", None) or ""),
            max_run_time=max_run_time if max_run_time is None or max_run_time > 0 else None,
            backfill=get(HEADER_BACKFILL) is True,
        )
