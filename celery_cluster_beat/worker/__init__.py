"""The worker side: run each scheduled occurrence once, and let the task body know which it is.

Owns the message protocol between beat and the worker (:mod:`.protocol`: the
``cluster_beat_*`` header names, :class:`OccurrenceContext`) and the task base class
(:mod:`.task`: :class:`LedgerTask`) that records each run in the claim store's
ledger columns, so a second delivery of an occurrence is recognised and not run;
each process running ledger tasks heartbeats (:mod:`.liveness`), so a run is taken over
only when its process is gone, and a worker's main process records the end of a run its
pool child could not (:mod:`.outcomes`). A delivery whose headers beat cannot have written
(an instant ahead of the database's clock with no claim row, a schedule that runs another task)
is refused, never recorded (:mod:`.provenance`, :mod:`..store.provenance`).
The ledger's SQL lives in the store (:mod:`..store.ledger`); beat's overlap guard
reads it back.

May import: store, config, schedules, errors, signals, base. Never beat: a worker
does not load the scheduler.
"""
from .protocol import OccurrenceContext
from .task import LedgerTask, LedgerUnavailable, current_occurrence

__all__ = ["LedgerTask", "LedgerUnavailable", "OccurrenceContext", "current_occurrence"]
