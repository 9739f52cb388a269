"""The SQL tick-claim store: the one place that makes "at most once" true.

Every replica computes the same occurrences (schedule name, nominal UTC
instant). Before sending one, a replica inserts its row into
``cluster_beat_claims`` whose primary key is exactly that pair, with an
insert-if-absent that is atomic in each dialect; it sends only the rows *it*
inserted. Two replicas can therefore both decide an occurrence is due, but
only one of them can win the row.

A leader lease (Redis, elsewhere) hands out a fencing token ("term") with
INCR. Each claiming transaction first raises ``cluster_beat_leader.term`` to
its own term with ``UPDATE ... WHERE term < :term OR (term = :term AND node =
:me)``: a deposed leader whose lease expired while it was paused finds a higher
term recorded (or its own term held by another node) and is refused
(:class:`StaleTermError`) in the same transaction that would have inserted its
claims, so it cannot claim anything after a newer leader has claimed.

Who may send a claimed row: its claimant, which confirms the row is still its
own just before publishing (:meth:`ClaimStore.confirm`); another node only once
the claimant is known to be gone by the database's clock: its heartbeat in
``cluster_beat_nodes`` is older than the grace, the claim is older than the
claimant's current start, or the claimant handed it over
(:meth:`ClaimStore.release`). Every time compared across nodes is the
database's (:meth:`ClaimStore.db_now`), never a node's own clock.

Design rules followed throughout:

* every method is one short transaction (or a bounded series of them for
  :meth:`ClaimStore.prune`); nothing holds a transaction open across a send;
* locks are taken in one global order (leader row, claim rows sorted by key,
  schedule rows sorted by name), so concurrent replicas queue rather than
  deadlock; a deadlock the server still reports is retried a few times;
* datetimes are naive UTC in the database (portable across the three
  dialects), aware UTC in Python.

Where each part lives (one concern a module, mixed into :class:`ClaimStore`):
:mod:`.engine` (URL, engine, pool, the transaction runner), :mod:`.prepare`
(creating and migrating the tables on open), :mod:`.claiming` (claim, confirm,
mark sent/failed, the fence), :mod:`.takeover` (heartbeats, release, the
stale-claim sweep), :mod:`.reads` (term, per-schedule state, nodes, claim rows),
:mod:`.pruning`, and the query families of the worker ledger (:mod:`.ledger`),
stored schedules (:mod:`.stored`), operators' controls (:mod:`.controls`),
reports (:mod:`.opsqueries`) and the status page (:mod:`.pagequeries`). This module only assembles them.
"""
from __future__ import annotations

from .claiming import ClaimQueries
from .controls import ControlQueries
from .engine import StoreEngine
from .errors import SchemaVersionError, StaleTermError, StoreUnavailable  # noqa: F401
from .ledger import LedgerQueries
from .opsqueries import OpsQueries
from .pagequeries import PageQueries
from .backfill import BackfillQueries
from .failures import FailureQueries
from .prepare import SchemaPreparation
from .pruning import PRUNE_STATEMENT_TIMEOUT, PruneQueries  # noqa: F401  (importable from here as before)
from .reads import StateQueries
from .schema import SCHEMA_VERSION, STATUSES, ClaimRow, ClaimStatus, NodeState, ScheduleState  # noqa: F401
from .stored import StoredScheduleQueries
from .takeover import RELEASED, TakeoverQueries  # noqa: F401

__all__ = [
    "SCHEMA_VERSION",
    "ClaimRow",
    "ClaimStore",
    "ScheduleState",
    "SchemaVersionError",
    "StaleTermError",
    "STATUSES",
]


class ClaimStore(
    ClaimQueries,
    TakeoverQueries,
    StateQueries,
    PruneQueries,
    LedgerQueries,
    StoredScheduleQueries,
    ControlQueries,
    BackfillQueries,
    FailureQueries,
    OpsQueries,
    PageQueries,
    SchemaPreparation,
    StoreEngine,
):
    """Atomic, fenced claims of occurrences in a SQL database shared by all replicas."""
