"""The claim store's tables and row types (SQLAlchemy Core), apart from the queries.

Datetimes are naive UTC in the database (portable across SQLite, PostgreSQL and
MySQL/MariaDB) and aware UTC in Python; names compare byte for byte everywhere.
How each server stores those two is :mod:`.types`'s; this module imports nothing
of :mod:`.dialects`, which builds its statements on these tables.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

import sqlalchemy as sa

from ..base import MAX_NAME_LENGTH, MAX_NODE_ID_LENGTH, StrEnum
from ..schedules.occurrence import Occurrence
from .types import NameType, UTCDateTime, naive_utc  # noqa: F401  (naive_utc: importable from here as before)

#: Version of the tables below. Bump it (and add the step to :data:`MIGRATIONS`)
#: whenever a released schema changes.
SCHEMA_VERSION = 6


class ClaimStatus(StrEnum):
    """Where an occurrence's row stands. Every occurrence ends as one of the last four."""

    CLAIMED = "claimed"  # taken by a node, not yet published
    SENT = "sent"
    SKIPPED = "skipped"  # deliberately not sent (overlap guard)
    MISSED = "missed"  # fell due while nobody could send it (catch-up policy)
    FAILED = "failed"  # publishing failed for good


STATUSES = tuple(s.value for s in ClaimStatus)


class RunState(StrEnum):
    """The worker-side ledger's column on a claim row: how the occurrence's run went.

    None (no run started yet) -> RUNNING -> SUCCEEDED / FAILED / RETRIED / LOST; a RETRIED run
    goes RUNNING again when Celery redelivers its retry (same task id), a LOST one when the
    broker redelivers its requeued message (the worker's main process recorded the loss).
    """

    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    RETRIED = "retried"
    #: The process running it died (or was killed at a hard time limit) and Celery requeued the
    #: message: the next delivery runs it again at once.
    LOST = "lost"


#: Longest error summary the ledger keeps per run (class and first line of the message).
RUN_ERROR_LENGTH = 500


#: Width of the task id column: a Celery task id is a UUID in its 36-character form.
TASK_ID_LENGTH = 36


_MYSQL_TABLE: dict[str, Any] = {"mysql_engine": "InnoDB", "mysql_charset": "utf8mb4"}

metadata = sa.MetaData()

claims_table = sa.Table(
    "cluster_beat_claims",
    metadata,
    sa.Column("schedule", NameType(MAX_NAME_LENGTH), primary_key=True),
    sa.Column("scheduled_at", UTCDateTime(), primary_key=True),
    sa.Column("claimed_at", UTCDateTime(), nullable=False),
    sa.Column("node", NameType(MAX_NODE_ID_LENGTH), nullable=False),
    sa.Column("term", sa.BigInteger(), nullable=True),
    sa.Column("task_id", sa.String(TASK_ID_LENGTH), nullable=False),
    sa.Column("status", sa.String(16), nullable=False),
    sa.Column("reason", sa.Text(), nullable=True),
    sa.Column("attempts", sa.Integer(), nullable=False, server_default="0"),
    sa.Column("sent_at", UTCDateTime(), nullable=True),
    # Random id of the statement that last wrote the row. MySQL has no
    # INSERT/UPDATE ... RETURNING, so when only some of a batch's rows were
    # inserted/changed, which ones is answered by selecting, among the
    # batch's keys, those carrying this token, in the same transaction:
    # exact under concurrency. (Looked up through the primary key, so it
    # needs no index of its own.)
    sa.Column("op_token", sa.String(32), nullable=True),
    # The worker-side ledger (celery_cluster_beat.worker): one atomic transition per run, so
    # a second delivery of the same occurrence is recognised and not run.
    sa.Column("run_state", sa.String(16), nullable=True),
    sa.Column("run_token", sa.String(32), nullable=True),
    sa.Column("worker", NameType(MAX_NODE_ID_LENGTH), nullable=True),
    sa.Column("worker_pid", sa.Integer(), nullable=True),
    sa.Column("started_at", UTCDateTime(), nullable=True),
    sa.Column("finished_at", UTCDateTime(), nullable=True),
    sa.Column("runtime", sa.Float(), nullable=True),  # seconds, by the worker's monotonic clock
    sa.Column("run_error", sa.Text(), nullable=True),
    sa.Column("duplicates", sa.Integer(), nullable=True),  # deliveries not run because one already was
    # Version 4: the process that holds the run (cluster_beat_workers.process): a running run is
    # taken over only when that process is known gone, by the database's clock.
    sa.Column("run_process", NameType(MAX_NODE_ID_LENGTH), nullable=True),
    # Celery's retry number of the attempt holding the run (any int: retries are unbounded).
    sa.Column("run_attempt", sa.BigInteger(), nullable=True),
    # The one pending "check later" copy of the message (acks_late): its id and when it is due.
    sa.Column("check_token", sa.String(32), nullable=True),
    sa.Column("check_at", UTCDateTime(), nullable=True),
    # Version 6: why the row was claimed when that is not the schedule's own fire: ``backfill``
    # (an operator's backfill). Kept when the reason is rewritten (a failed publish, a release),
    # so a resend still says so and history still shows it.
    sa.Column("origin", sa.String(16), nullable=True),
    sa.CheckConstraint(
        "status IN (%s)" % ", ".join("'%s'" % s for s in STATUSES),
        name="ck_cluster_beat_claims_status",
    ),
    sa.Index("ix_cluster_beat_claims_status_claimed_at", "status", "claimed_at"),
    sa.Index("ix_cluster_beat_claims_scheduled_at", "scheduled_at"),
    # Version 6: the leader's pass over runs that failed lately (pause_after_failures) reads
    # ``run_state = 'failed' AND finished_at > :since`` through this index, not the whole table.
    sa.Index("ix_cluster_beat_claims_run_state_finished_at", "run_state", "finished_at"),
    **_MYSQL_TABLE,
)

#: The claim table's primary key, (schedule name, nominal instant): what a claim
#: is of. Statements keyed by claims take these columns first, in this order.
CLAIM_KEY: tuple[str, ...] = tuple(col.name for col in claims_table.primary_key)

_COUNTERS = ("sent", "skipped", "missed", "failed", "claim_lost", "resent")

schedules_table = sa.Table(
    "cluster_beat_schedules",
    metadata,
    sa.Column("name", NameType(MAX_NAME_LENGTH), primary_key=True),
    sa.Column("last_occurrence", UTCDateTime(), nullable=True),
    sa.Column("last_task_id", sa.String(TASK_ID_LENGTH), nullable=True),
    sa.Column("last_sent_at", UTCDateTime(), nullable=True),
    # The nominal instant of last_task_id's occurrence: the overlap guard's "last run"
    # only moves forward, so a late resend of an older occurrence cannot replace it.
    sa.Column("last_sent_occurrence", UTCDateTime(), nullable=True),
    sa.Column("last_error", sa.Text(), nullable=True),
    # When a scheduling node first saw the schedule (database clock): a first occurrence
    # that falls due before any node claimed one is caught up from here, not lost.
    sa.Column("registered_at", UTCDateTime(), nullable=True),
    sa.Column("last_error_at", UTCDateTime(), nullable=True),
    *[sa.Column(c, sa.BigInteger(), nullable=False, server_default="0") for c in _COUNTERS],
    sa.Column("updated_at", UTCDateTime(), nullable=False),
    **_MYSQL_TABLE,
)

leader_table = sa.Table(
    "cluster_beat_leader",
    metadata,
    sa.Column("id", sa.Integer(), primary_key=True, autoincrement=False),
    sa.Column("term", sa.BigInteger(), nullable=False),
    sa.Column("node", NameType(MAX_NODE_ID_LENGTH), nullable=True),
    sa.Column("updated_at", UTCDateTime(), nullable=False),
    **_MYSQL_TABLE,
)

nodes_table = sa.Table(
    "cluster_beat_nodes",
    metadata,
    # Every node that ran against this store, with the database's time of its start and
    # of its last heartbeat: a claim is taken over only when its claimant is known to be
    # gone by that clock (heartbeat older than claim_grace, or the claim older than the
    # node's current start), never by the claim's age alone.
    sa.Column("node", NameType(MAX_NODE_ID_LENGTH), primary_key=True),
    sa.Column("started_at", UTCDateTime(), nullable=False),
    sa.Column("heartbeat_at", UTCDateTime(), nullable=False),
    sa.Column("scheduling", sa.Boolean(), nullable=False, server_default=sa.false()),
    sa.Column("clock_offset", sa.Float(), nullable=True),  # seconds: database clock minus the node's
    # Set (database clock) when the node shut down cleanly, cleared when it starts again: lets
    # operators tell "stopped" (a deploy, SIGTERM) from "gone" (heartbeat lost, a crash).
    sa.Column("stopped_at", UTCDateTime(), nullable=True),
    sa.Index("ix_cluster_beat_nodes_heartbeat_at", "heartbeat_at"),
    **_MYSQL_TABLE,
)

stored_schedules_table = sa.Table(
    "cluster_beat_stored_schedules",
    metadata,
    # Schedules an application creates at run time (celery_cluster_beat.dynamic). A removed
    # one stays as a tombstone (deleted) until pruned, so the leader, which reads only rows
    # changed since the version it last saw, learns of removals too.
    sa.Column("name", NameType(MAX_NAME_LENGTH), primary_key=True),
    sa.Column("task", sa.String(MAX_NAME_LENGTH), nullable=False),
    sa.Column("schedule", sa.Text(), nullable=False),  # schedules.text form: cron fields or "every ..."
    sa.Column("zone", sa.String(64), nullable=True),
    sa.Column("args", sa.Text(), nullable=False),  # JSON
    sa.Column("kwargs", sa.Text(), nullable=False),  # JSON
    sa.Column("options", sa.Text(), nullable=False),  # JSON
    sa.Column("overlap", sa.String(16), nullable=True),
    sa.Column("max_run_time", sa.Float(), nullable=True),
    sa.Column("jitter", sa.Float(), nullable=True),
    sa.Column("catchup", sa.String(16), nullable=True),
    sa.Column("catchup_window", sa.Float(), nullable=True),
    sa.Column("description", sa.Text(), nullable=True),
    sa.Column("owner", sa.String(MAX_NAME_LENGTH), nullable=True),
    sa.Column("enabled", sa.Boolean(), nullable=False),
    sa.Column("deleted", sa.Boolean(), nullable=False, server_default=sa.false()),
    # The change counter's value when this row last changed (cluster_beat_schedule_version).
    sa.Column("version", sa.BigInteger(), nullable=False),
    sa.Column("created_at", UTCDateTime(), nullable=False),
    sa.Column("changed_at", UTCDateTime(), nullable=False),
    # Its next occurrence (database clock), kept exact while the leader does not hold the
    # schedule in memory: the leader loads only what falls due within its horizon.
    sa.Column("next_at", UTCDateTime(), nullable=True),
    # Version 6: pause the schedule after this many consecutive failed runs (None: never).
    sa.Column("pause_after_failures", sa.Integer(), nullable=True),
    # Version 6: bounds on when it fires (schedules/bounds.py); max_runs counts from start_at, else
    # from created_at. ended_at: when its rule was found to have no further occurrence (a one-off
    # that fired, a bound passed), database clock; next_at is then NULL and no leader loads it again.
    sa.Column("start_at", UTCDateTime(), nullable=True),
    sa.Column("end_at", UTCDateTime(), nullable=True),
    sa.Column("max_runs", sa.Integer(), nullable=True),
    sa.Column("ended_at", UTCDateTime(), nullable=True),
    # The last instant max_runs allows (from start_at, else created_at), computed by the API when it
    # writes the row, so the leader bounds the row by it and never walks the count.
    sa.Column("runs_end_at", UTCDateTime(), nullable=True),
    sa.Index("ix_cluster_beat_stored_schedules_version", "version"),
    sa.Index("ix_cluster_beat_stored_schedules_next_at", "next_at"),
    **_MYSQL_TABLE,
)

controls_table = sa.Table(
    "cluster_beat_controls",
    metadata,
    # Operators' actions on a schedule, config or stored alike (celery ... cluster-beat pause /
    # resume / run-now): kept apart from the definitions so a config entry can be paused too,
    # and stamped with the change counter so the leader reads only what changed.
    sa.Column("name", NameType(MAX_NAME_LENGTH), primary_key=True),
    sa.Column("paused", sa.Boolean(), nullable=False, server_default=sa.false()),
    sa.Column("paused_at", UTCDateTime(), nullable=True),
    sa.Column("paused_by", sa.String(MAX_NAME_LENGTH), nullable=True),
    # Why it was paused, in the operator's words (shown by list, status and the page).
    sa.Column("paused_note", sa.Text(), nullable=True),
    # When it was last resumed (database clock): any leader, now or after a failover, starts
    # it from here, so the paused time is never caught up.
    sa.Column("resumed_at", UTCDateTime(), nullable=True),
    # A pending "run now" request: its id, and the database's time it was asked, which becomes
    # the manual occurrence's instant. A second request while one is pending joins it.
    sa.Column("run_request", sa.String(36), nullable=True),
    sa.Column("run_requested_at", UTCDateTime(), nullable=True),
    sa.Column("run_requested_by", sa.String(MAX_NAME_LENGTH), nullable=True),
    sa.Column("version", sa.BigInteger(), nullable=False),
    sa.Index("ix_cluster_beat_controls_version", "version"),
    **_MYSQL_TABLE,
)

class BackfillState(StrEnum):
    """Where a backfill request (``cluster_beat_backfills``) stands."""

    PENDING = "pending"  # recorded by the command; no leader has handled it yet
    DONE = "done"  # the leader claimed its occurrences and sent what it won
    REFUSED = "refused"  # the leader could not handle it (no such schedule, too many occurrences)
    FAILED = "failed"  # the leader stopped serving it part way (the error); the counts say what went out


backfills_table = sa.Table(
    "cluster_beat_backfills",
    metadata,
    # ``celery ... cluster-beat backfill NAME --from T1 --to T2``: the command records the request,
    # the leader claims and sends its occurrences (reason ``backfill``) and writes the result back.
    # A new table of version 6: create_all makes it, no migration step.
    sa.Column("id", sa.String(36), primary_key=True),
    sa.Column("schedule", NameType(MAX_NAME_LENGTH), nullable=False),
    sa.Column("from_at", UTCDateTime(), nullable=False),
    sa.Column("to_at", UTCDateTime(), nullable=False),
    sa.Column("max_count", sa.Integer(), nullable=False),
    sa.Column("state", sa.String(16), nullable=False),
    sa.Column("requested_at", UTCDateTime(), nullable=False),
    sa.Column("requested_by", sa.String(MAX_NAME_LENGTH), nullable=True),
    sa.Column("finished_at", UTCDateTime(), nullable=True),
    sa.Column("node", NameType(MAX_NODE_ID_LENGTH), nullable=True),
    # The result: occurrences claimed and sent by the backfill, those left as they were (JSON
    # object: reason -> count), and why a refused request was refused.
    sa.Column("sent", sa.Integer(), nullable=True),
    sa.Column("not_sent", sa.Text(), nullable=True),
    sa.Column("error", sa.Text(), nullable=True),
    # Progress, written after each slice the leader served (a new leader goes on from done_to):
    # the last instant served, occurrences whose publish failed for good (JSON: reason -> count)
    # and those still claimed when their slice ended (a publish retry, or left to the next sender).
    sa.Column("done_to", UTCDateTime(), nullable=True),
    sa.Column("failed", sa.Text(), nullable=True),
    sa.Column("retrying", sa.Integer(), nullable=True),
    sa.Index("ix_cluster_beat_backfills_state", "state"),
    **_MYSQL_TABLE,
)

schedule_version_table = sa.Table(
    "cluster_beat_schedule_version",
    metadata,
    # One row: bumped in the same transaction as every change to a stored schedule. Its row
    # lock serialises changers, so versions commit in order and "changed since N" is exact.
    sa.Column("id", sa.Integer(), primary_key=True, autoincrement=False),
    sa.Column("version", sa.BigInteger(), nullable=False),
    **_MYSQL_TABLE,
)

workers_table = sa.Table(
    "cluster_beat_workers",
    metadata,
    # Each worker process that runs ledger tasks (a prefork pool child, or the worker itself
    # for the solo / threads pools), heartbeating from a thread of its own. Times are the
    # database's: the process is alive until expires_at (its last heartbeat plus its grace),
    # or until gone_at is set (its worker's main process saw it die, one of its runs was taken
    # over, or it heartbeat after expiring): gone is for good, the process goes on under a new
    # id. host and pid are informative: a process is only ever judged by its id (store/liveness.py).
    sa.Column("process", NameType(MAX_NODE_ID_LENGTH), primary_key=True),  # host:pid:random
    sa.Column("host", NameType(MAX_NODE_ID_LENGTH), nullable=False),
    sa.Column("pid", sa.Integer(), nullable=False),
    sa.Column("started_at", UTCDateTime(), nullable=False),
    sa.Column("heartbeat_at", UTCDateTime(), nullable=False),
    sa.Column("expires_at", UTCDateTime(), nullable=False),
    sa.Column("gone_at", UTCDateTime(), nullable=True),
    sa.Column("gone_reason", sa.Text(), nullable=True),
    sa.Index("ix_cluster_beat_workers_host_pid", "host", "pid"),
    sa.Index("ix_cluster_beat_workers_expires_at", "expires_at"),
    **_MYSQL_TABLE,
)

meta_table = sa.Table(
    "cluster_beat_meta",
    metadata,
    sa.Column("key", sa.String(64), primary_key=True),
    sa.Column("value", sa.String(255), nullable=False),
    **_MYSQL_TABLE,
)


@dataclass(frozen=True)
class ClaimRow:
    """One row of ``cluster_beat_claims`` as an operator reads it."""

    schedule: str
    scheduled_at: datetime
    claimed_at: datetime
    node: str
    term: int | None
    task_id: str
    status: str
    reason: str | None
    attempts: int
    sent_at: datetime | None
    run_state: str | None = None
    worker: str | None = None
    worker_pid: int | None = None
    started_at: datetime | None = None
    finished_at: datetime | None = None
    runtime: float | None = None
    run_error: str | None = None
    duplicates: int | None = None
    run_process: str | None = None
    run_attempt: int | None = None
    origin: str | None = None  #: ``backfill`` on a backfill's rows (whatever their reason says now)

    @property
    def occurrence(self) -> Occurrence:
        return Occurrence(self.schedule, self.scheduled_at, task_id=self.task_id)


@dataclass(frozen=True)
class ScheduleState:
    """Per-schedule state kept apart from the claim rows so it survives pruning."""

    name: str
    last_occurrence: datetime | None
    last_task_id: str | None
    last_sent_at: datetime | None
    last_error: str | None
    last_error_at: datetime | None
    sent: int
    skipped: int
    missed: int
    failed: int
    claim_lost: int
    resent: int
    updated_at: datetime
    last_sent_occurrence: datetime | None = None
    registered_at: datetime | None = None


@dataclass(frozen=True)
class NodeState:
    """One row of ``cluster_beat_nodes``: a node as the database last heard of it."""

    node: str
    started_at: datetime
    heartbeat_at: datetime
    scheduling: bool
    clock_offset: float | None
    #: When it shut down cleanly (database clock); None while it runs, after a crash, and once it
    #: starts again. A node whose heartbeat is not newer than this stopped; one whose heartbeat
    #: lapsed without it is gone.
    stopped_at: datetime | None = None


def _add_column(table: sa.Table, name: str) -> Any:
    """A migration step adding *table*'s column *name* as the table defines it."""

    def step(conn: Any) -> None:
        # Idempotent: MySQL/MariaDB commit DDL at once, so a node stopped between this
        # step and the version stamp leaves the column behind for the next opener.
        inspector = sa.inspect(conn)
        if not inspector.has_table(table.name):
            return  # a table newer than the store (nodes before version 2): create_all makes it whole
        if name in {c["name"] for c in inspector.get_columns(table.name)}:
            return
        col = table.c[name]
        ddl = col.type.compile(dialect=conn.dialect)
        conn.exec_driver_sql(f"ALTER TABLE {table.name} ADD COLUMN {name} {ddl} NULL")

    return step


def _attempts_from_tokens(conn: Any) -> None:
    """Version 3 kept the attempt of an unfinished run as the 4-digit prefix of its run token."""
    c = claims_table
    for token, in conn.execute(sa.select(c.c.run_token).where(
            c.c.run_state.in_(["running", "retried"]), c.c.run_token.is_not(None), c.c.run_attempt.is_(None))).all():
        if token[:4].isdigit():
            conn.execute(sa.update(c).where(c.c.run_token == token).values(run_attempt=int(token[:4])))


def _add_index(index: sa.Index) -> Any:
    """A migration step creating *index* (of an existing table) unless it is there already."""

    def step(conn: Any) -> None:
        inspector = sa.inspect(conn)
        if not inspector.has_table(index.table.name):
            return
        if index.name in {i["name"] for i in inspector.get_indexes(index.table.name)}:
            return
        index.create(conn)

    return step


def _index(table: sa.Table, name: str) -> sa.Index:
    return next(i for i in table.indexes if i.name == name)


#: Version 5 -> 6, for backfills and ``pause_after_failures`` (the backfill requests' table is new:
#: create_all makes it). Kept apart from the other version-6 steps; both lists make MIGRATIONS[5].
_BACKFILL_AND_FAILURE_COLUMNS = [
    _add_column(stored_schedules_table, "pause_after_failures"),
    _add_column(claims_table, "origin"),
    _add_index(_index(claims_table, "ix_cluster_beat_claims_run_state_finished_at")),
]

#: Version 5 -> 6, bounds and one-offs: stored schedules' start_at, end_at, max_runs and ended_at
#: (NULL on existing rows: no bounds, not ended, which is what they were).
_BOUNDS_COLUMNS = [_add_column(stored_schedules_table, c) for c in ("start_at", "end_at", "max_runs", "ended_at",
                                                                      "runs_end_at")]

#: version -> the steps that bring a store of that version to the next one. New tables
#: are created by ``create_all``; only changes to existing tables are listed here.
MIGRATIONS = {
    1: [_add_column(schedules_table, "last_sent_occurrence"), _add_column(schedules_table, "registered_at")],
    2: [_add_column(claims_table, c) for c in ("run_state", "run_token", "worker", "worker_pid", "started_at",
                                                 "finished_at", "runtime", "run_error", "duplicates")],
    3: [*(_add_column(claims_table, c) for c in ("run_process", "run_attempt", "check_token", "check_at")),
        lambda conn: _attempts_from_tokens(conn)],
    4: [_add_column(nodes_table, "stopped_at"), _add_column(controls_table, "paused_note")],
    5: [*_BACKFILL_AND_FAILURE_COLUMNS, *_BOUNDS_COLUMNS],
}
