"""The SQL tick-claim store: the one place that makes "at most once" true.

Owns the tables (:mod:`.schema`) and their column types (:mod:`.types`), the
public :class:`ClaimStore` API (:mod:`.claims`, assembled from one module per
concern: :mod:`.engine`, :mod:`.prepare`, :mod:`.claiming`, :mod:`.takeover`,
:mod:`.reads`, :mod:`.pruning`, :mod:`.ledger` with its checks of what a delivery's
headers say (:mod:`.provenance`), :mod:`.stored`, :mod:`.controls`, :mod:`.backfill` (backfill requests and their
claim rule), :mod:`.failures` (reads of failed runs), :mod:`.opsqueries`,
:mod:`.pagequeries`), and the per-dialect SQL behind one seam
(:mod:`.dialects`: SQLite, PostgreSQL, MySQL/MariaDB). Callers see
occurrences, statuses and :class:`StoreUnavailable`, never SQLAlchemy.

May import: SQLAlchemy, schedules (occurrences), errors, base, faults. Nothing from
leader, config or beat: a fencing term arrives as a plain integer.
"""
from .claims import ClaimStore
from .errors import SchemaVersionError, StaleTermError, StoreUnavailable
from .schema import SCHEMA_VERSION, ClaimRow, ClaimStatus, NodeState, ScheduleState

__all__ = ["ClaimStore", "ClaimRow", "ClaimStatus", "NodeState", "ScheduleState", "SCHEMA_VERSION",
           "SchemaVersionError", "StaleTermError", "StoreUnavailable"]
