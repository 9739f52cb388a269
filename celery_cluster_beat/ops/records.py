"""The records operators' reports return: frozen, JSON-safe through ``as_dict()``, never a secret.

Apart from the reads that build them (:mod:`.report`, :mod:`.schedulepage`) so both can use
them without importing each other; :mod:`.report` re-exports every one of them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Dict, Optional, Tuple

from ..base import StrEnum
from ..store import ClaimRow
from .words import bounds_words

__all__ = ["ClusterStatus", "LeaseInfo", "NodeInfo", "NodeStatus", "PausedInfo", "UnsentOccurrence", "ScheduleInfo",
           "Counters", "HistoryRow", "MANUAL", "BACKFILL"]

#: The reason a claim row of an operator's run-now carries.
MANUAL = "manual"
#: The reason on a backfill's claim rows (store.backfill.BACKFILL_REASON).
BACKFILL = "backfill"


def _plain(value: Any) -> Any:
    if isinstance(value, StrEnum):
        return value.value
    if isinstance(value, datetime):
        return value.isoformat()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


class _AsDict:
    def as_dict(self) -> Dict[str, Any]:
        """JSON-safe: times as ISO 8601 strings, nested records as dicts."""
        return _plain(self)


@dataclass(frozen=True)
class LeaseInfo(_AsDict):
    """The leader lease as Redis holds it right now."""

    enabled: bool  #: a Redis lease is configured (else every replica schedules and races on claims)
    redis_url: Optional[str]  #: masked
    key: Optional[str]  #: the lease's Redis key
    holder: Optional[str]  #: node id of the leader, None when nobody holds the lease
    term: Optional[int]  #: the holder's fencing term
    expires_in: Optional[float]  #: seconds until the key expires unless renewed
    expires_at: Optional[datetime]  #: the same, on the database's clock
    error: Optional[str] = None  #: why Redis could not be read


class NodeStatus(StrEnum):
    """Where a beat node stands, as ``status`` and the dashboard say it."""

    LEADER = "leader"  #: holds the lease (without a lease: last raised the term)
    UP = "up"  #: heartbeat within the claim grace
    #: Shut down cleanly (SIGTERM: lease and claims handed over) and not heard from since.
    STOPPED = "stopped"
    #: Heartbeat older than the claim grace without a clean stop: crashed, killed, cut off.
    GONE = "gone"


@dataclass(frozen=True)
class NodeInfo(_AsDict):
    """A beat node the claim store heard from recently."""

    node: str
    state: NodeStatus  #: a str: ``leader``, ``up``, ``stopped`` or ``gone``
    #: It said so in its last heartbeat; False for a stopped or gone node, whatever it last said.
    scheduling: bool
    started_at: datetime
    heartbeat_at: datetime
    heartbeat_age: float  #: seconds, by the database's clock
    clock_offset: Optional[float]  #: seconds: database clock minus the node's
    stopped_at: Optional[datetime] = None  #: when it shut down cleanly (``stopped`` nodes only)


@dataclass(frozen=True)
class PausedInfo(_AsDict):
    """A paused schedule: who paused it, when, and why."""

    name: str
    paused_at: Optional[datetime]
    paused_by: Optional[str]
    paused_note: Optional[str]


@dataclass(frozen=True)
class UnsentOccurrence(_AsDict):
    """An occurrence claimed longer than the claim grace ago and still not sent."""

    schedule: str
    scheduled_at: datetime
    claimed_at: datetime
    node: str
    attempts: int
    reason: Optional[str]
    age: float  #: seconds since it was claimed


@dataclass(frozen=True)
class ClusterStatus(_AsDict):
    """``status``: who leads, who runs, where the store is, and what is late right now."""

    cluster_name: str
    now: datetime  #: the database's clock
    db_url: str  #: masked
    schema_version: Optional[int]  #: recorded in the store
    code_schema_version: int  #: this release's
    leader: Optional[str]  #: the lease holder; without a lease, the node that last raised the term
    term: Optional[int]  #: the lease holder's term; without a lease, the store's
    store_term: int  #: the highest term the store recorded
    lease: LeaseInfo
    nodes: Tuple[NodeInfo, ...]
    schedules: int  #: config + stored
    config_schedules: int
    stored_schedules: int
    paused: Tuple[str, ...]
    claim_grace: float
    #: Claimed more than ``claim_grace`` ago and not sent. Occurrences due but never claimed
    #: (no leader running) leave no row, so they cannot be counted here.
    unsent: int
    unsent_shown: Tuple[UnsentOccurrence, ...]
    #: How many are paused (``paused`` names only the first ones when the caller limited it).
    paused_count: int = 0
    #: The schedules of ``paused``, same order, with who paused each, when and why.
    paused_details: Tuple[PausedInfo, ...] = ()


@dataclass(frozen=True)
class Counters(_AsDict):
    """A schedule's occurrences by outcome since it was first recorded, as the claim store keeps
    them (per schedule, so they outlive pruned claim rows): what ``list`` shows as
    ``SENT/SKIP/MISS/FAIL``."""

    sent: int = 0
    skipped: int = 0
    missed: int = 0
    failed: int = 0
    claim_lost: int = 0
    resent: int = 0


@dataclass(frozen=True)
class ScheduleInfo(_AsDict):
    """``list``: one schedule, config or stored."""

    name: str
    task: str
    source: str  #: ``config`` (beat_schedule or Celery's default entries) or ``stored``
    schedule: str  #: cron fields, ``every <n>s [from HH:MM]``, or the rule's repr
    zone: Optional[str]  #: the zone the rule is read in (None: an interval on the UTC grid)
    enabled: bool
    paused: bool
    paused_at: Optional[datetime]
    paused_by: Optional[str]
    run_requested_at: Optional[datetime]  #: a run-now request still pending
    next_fire: Optional[datetime]  #: computed (None when disabled, paused or invalid); jitter not included
    last_occurrence: Optional[datetime]
    last_status: Optional[str]  #: the last occurrence's claim status (sent, skipped, missed, failed, claimed)
    last_run_state: Optional[str]  #: its run, when the task uses the ledger (running, succeeded, failed, retried)
    last_reason: Optional[str]
    last_sent_at: Optional[datetime]
    last_error: Optional[str]
    last_error_at: Optional[datetime]
    counters: Counters
    owner: Optional[str] = None
    description: str = ""
    problem: Optional[str] = None  #: a stored row that no longer validates
    paused_note: Optional[str] = None  #: why it was paused, in the operator's words
    #: Its overlap policy as the leader applies it (an ``OverlapPolicy`` value: ``skip``, ``allow``,
    #: ``buffer_one``, ``replace``); None for a stored row that does not validate.
    overlap: Optional[str] = None
    rule: Optional[str] = None  #: the rule in words with its zone ("At 02:30, Monday through Friday (UTC)")
    compact: Optional[str] = None  #: the rule's short form (``0 4 * * *``, ``every 6h from 02:30``)
    #: Bounds (schedules/bounds.py): fired only in [start_at, end_at], at most max_runs times from its start.
    start_at: Optional[datetime] = None
    end_at: Optional[datetime] = None
    max_runs: Optional[int] = None
    #: Its rule has no further occurrence (a one-off that fired, a bound passed): it never fires again.
    ended: bool = False
    ended_at: Optional[datetime] = None  #: when a leader found it ended (stored schedules; database clock)

    @property
    def state(self) -> str:
        """``invalid``, ``paused``, ``ended``, ``enabled`` or ``disabled``."""
        if self.problem:
            return "invalid"
        if self.paused:
            return "paused"
        if self.ended and self.enabled:
            return "ended"
        return "enabled" if self.enabled else "disabled"

    @property
    def bounds(self) -> str:
        """The bounds in words (``from 2026-12-07 15:00Z, until ..., at most 2 runs``); empty without."""
        return bounds_words(self.start_at, self.end_at, self.max_runs)

    @property
    def outcome(self) -> Optional[str]:
        """The last occurrence in one word or two: its run state if known, else its claim status."""
        if self.last_status is None:
            return None
        if self.last_run_state:
            return self.last_run_state
        if self.last_status in ("skipped", "failed") and self.last_reason:
            return f"{self.last_status} ({self.last_reason.split(':', 1)[0][:40]})"
        return self.last_status

    def as_dict(self) -> Dict[str, Any]:
        out = _plain(self)
        out["outcome"] = self.outcome
        out["state"] = self.state
        out["bounds"] = self.bounds
        return out


@dataclass(frozen=True)
class HistoryRow(_AsDict):
    """``history``: one occurrence, from its claim row and the worker's ledger."""

    schedule: str
    scheduled_at: datetime
    status: str
    manual: bool  #: an operator's run-now
    reason: Optional[str]
    node: str  #: the beat node that claimed it
    term: Optional[int]
    task_id: str
    claimed_at: datetime
    sent_at: Optional[datetime]
    attempts: int
    run_state: Optional[str]
    worker: Optional[str]
    started_at: Optional[datetime]
    finished_at: Optional[datetime]
    runtime: Optional[float]
    error: Optional[str]  #: the run's error, or why the occurrence was not sent
    duplicates: Optional[int]
    backfill: bool = False  #: sent by an operator's backfill (``cluster-beat backfill``)

    @property
    def kind(self) -> str:
        """``manual`` (run-now), ``backfill`` or ``scheduled``."""
        return MANUAL if self.manual else BACKFILL if self.backfill else "scheduled"

    @classmethod
    def from_claim(cls, row: ClaimRow) -> "HistoryRow":
        error = row.run_error or (row.reason if row.status == "failed" else None)
        worker = f"{row.worker}:{row.worker_pid}" if row.worker and row.worker_pid else row.worker
        return cls(schedule=row.schedule, scheduled_at=row.scheduled_at, status=row.status,
                   manual=(row.reason or "").startswith(MANUAL), reason=row.reason, node=row.node, term=row.term,
                   task_id=row.task_id, claimed_at=row.claimed_at, sent_at=row.sent_at, attempts=row.attempts,
                   run_state=row.run_state, worker=worker, started_at=row.started_at, finished_at=row.finished_at,
                   runtime=row.runtime, error=error, duplicates=row.duplicates, backfill=BACKFILL in (row.origin, row.reason))
