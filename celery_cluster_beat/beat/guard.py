"""Overlap guard: do not start a schedule's run while its previous run is in flight.

"In flight" is read from Celery's result backend, for due schedules only
(never per tick for idle ones), in one batched read where the backend allows
it (one MGET on a key-value backend such as Redis, one SELECT on the database
backend). The last sent task id per schedule lives in SQL, so a new leader
honours the guard of the old one.

Policies (Temporal's names in brackets): ``skip`` [Skip], ``allow``
[AllowAll], ``buffer_one`` [BufferOne], ``replace`` [TerminateOther].

How the previous run's state is read:

* RECEIVED, STARTED, RETRY (or a custom progress state): in flight.
* PENDING: in flight while younger than ``max_run_time`` (it may be queued,
  or running without ``task_track_started``); older, it is "unknown" (the
  result expired or was never stored) and no longer blocks, quietly.
* SUCCESS, FAILURE, REVOKED, IGNORED: finished.
* The backend cannot be read: fail open (the run is sent), with a warning.
* No result backend at all: every run reads as PENDING, so a guarded
  schedule runs at most once per ``max_run_time`` (a start-up warning says so).

The decisions (:meth:`OverlapGuard.filter`) are apart from how states are
read (:class:`ResultBackendStates`, injected), so the decision table can be
exercised without a backend.

Entries whose task uses the worker-side ledger (its class is a
:class:`~celery_cluster_beat.worker.LedgerTask`, directly or through Celery's
``task_cls``) are read from the ledger instead (the claim row of the last sent
occurrence, one SELECT for all, injected as ``ledger``): a ``running`` or
``retried`` row is in flight; a row sent (or claimed) whose run has not started
is in flight while younger than ``max_run_time``; ``succeeded`` / ``failed``,
skipped, missed or failed sends, and a pruned row free the schedule. That needs
no result backend and works with ``ignore_result=True``.

The default policy guards only what it can observe (:meth:`OverlapGuard.policy`):
an explicit policy (the entry's ``overlap``, else a set ``cluster_beat_overlap``)
is used as written; otherwise a ledger task is guarded (``skip``) even without a
result backend, and a task that ignores its results (``ignore_result``, or
``task_ignore_result`` for a task beat does not know) is not guarded, since its
state would stay PENDING and every run would block the schedule for
``max_run_time``. A start-up warning names those entries
(:meth:`OverlapGuard.warn_about_configuration`), and an explicit guard on an
entry nobody can observe is a start-up error (:func:`configuration_problems`).

The watchdog: a run still *in flight* past ``max_run_time`` (a hung task, or a
worker that died with it STARTED) no longer blocks: the next fire goes through,
a warning is logged and ``watchdog_fired`` is sent, once per run. Under
``replace`` such a run is revoked like any other.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

from celery import states as celery_states

from .. import signals
from ..base import StrEnum
from ..config import Entry, OverlapPolicy, Settings
from ..config.celeryconf import has_result_backend
from ..config.observing import configuration_problems, ignores_results, uses_ledger  # noqa: F401 (re-exported)
from ..schedules.occurrence import Occurrence
from ..store import ClaimStatus, StoreUnavailable
from ..store.ledger import LedgerState
from ..store.schema import RunState

logger = logging.getLogger("celery_cluster_beat.guard")

#: States after which the previous run no longer blocks.
FINISHED = frozenset(celery_states.READY_STATES) | {celery_states.IGNORED}
#: How often a buffered occurrence re-reads its predecessor's state (seconds).
BUFFER_POLL = 0.25
#: The start-up warning names at most this many unguarded entries (then says how many more).
UNGUARDED_NAMED = 50



class Verdict(StrEnum):
    """The guard's verdict on the previous run of a schedule."""

    FREE = "free"  # finished, unknown-and-old, never sent, or unreadable (fail open)
    BUSY = "busy"  # in flight, younger than max_run_time
    OVERDUE = "overdue"  # in flight past max_run_time: the watchdog lets the next fire through


FREE, BUSY, OVERDUE = Verdict.FREE, Verdict.BUSY, Verdict.OVERDUE

Pair = Tuple[Entry, Occurrence]
#: Reads task states: task ids in, ``{task id: state}`` out; a state is None when it
#: cannot be read (the guard then fails open), PENDING when the backend has no record.
StateReader = Callable[[Sequence[str]], Dict[str, Optional[str]]]
#: Reads the ledger (``ClaimStore.run_states``): (schedule, nominal instant) keys in, the rows
#: found out; a key without a row (never claimed, or pruned) is missing from the answer.
LedgerReader = Callable[[Sequence[Tuple[str, datetime]]], Dict[Tuple[str, datetime], LedgerState]]
#: Ledger run states after which the run no longer blocks.
LEDGER_FINISHED = frozenset({RunState.SUCCEEDED.value, RunState.FAILED.value})
#: Claim statuses whose occurrence never went to a worker: nothing of it can be in flight.
NOT_SENT = frozenset({ClaimStatus.SKIPPED.value, ClaimStatus.MISSED.value, ClaimStatus.FAILED.value})


@dataclass
class GuardDecision:
    send: List[Pair] = field(default_factory=list)
    skipped: List[Pair] = field(default_factory=list)
    buffered: List[Pair] = field(default_factory=list)
    #: occurrence to send -> task id of the run it replaces (revoke it once the claim is ours)
    replaces: Dict[Occurrence, str] = field(default_factory=dict)


@dataclass
class _LastRun:
    task_id: str
    sent_at: datetime
    #: The nominal instant of that run's occurrence: the last run only ever moves forward.
    at: Optional[datetime] = None
    watchdog_fired: bool = False

    def older_than(self, at: Optional[datetime], sent_at: datetime) -> bool:
        """Whether a run of occurrence *at* (sent at *sent_at*) is newer than this one."""
        if at is not None and self.at is not None:
            return self.at < at
        return self.sent_at < sent_at


class ResultBackendStates:
    """Task states from the app's result backend, in one round trip where the backend allows it."""

    def __init__(self, app) -> None:
        self.app = app
        self._warned_at = float("-inf")

    def __call__(self, task_ids: Sequence[str]) -> Dict[str, Optional[str]]:
        """Task id -> state: PENDING for an id the backend does not know; None for
        every id when the backend cannot be read (the caller fails open)."""
        if not task_ids:
            return {}
        if not has_result_backend(self.app):
            return {t: celery_states.PENDING for t in task_ids}
        try:
            return self._read(self.app.backend, list(task_ids))
        except Exception as exc:  # backend down: fail open, a run is not blocked by an unknown
            mono = time.monotonic()
            if mono - self._warned_at >= 60:
                self._warned_at = mono
                logger.warning("cluster-beat: cannot read task states from the result backend, "
                               "overlap guard open: %r", exc)
            return {t: None for t in task_ids}

    @staticmethod
    def _read(backend, task_ids: List[str]) -> Dict[str, str]:
        pending = celery_states.PENDING
        if hasattr(backend, "get_key_for_task") and hasattr(backend, "mget"):
            keys = [backend.get_key_for_task(t) for t in task_ids]
            try:  # key-value backends (Redis: one MGET)
                values = backend.mget(keys)
            except NotImplementedError:
                pass
            else:
                if isinstance(values, Mapping):  # some (memcached) answer {key: value}, like Celery expects
                    values = [values.get(k) for k in keys]
                # decode(), not decode_result(): the status is all we need, no exception rebuilding.
                return {t: (backend.decode(raw) or {}).get("status", pending) if raw else pending
                        for t, raw in zip(task_ids, values)}
        task_cls = getattr(backend, "task_cls", None)
        if task_cls is not None and hasattr(backend, "ResultSession"):  # database backend: one SELECT
            session = backend.ResultSession()
            try:
                rows = session.query(task_cls.task_id, task_cls.status).filter(task_cls.task_id.in_(task_ids)).all()
                session.rollback()  # read only: end the transaction, keep no locks or snapshot
            finally:
                session.close()
            found = {tid: status for tid, status in rows}
            return {t: found.get(t) or pending for t in task_ids}
        return {t: backend._get_task_meta_for(t).get("status", pending) for t in task_ids}


class OverlapGuard:
    def __init__(self, app, settings: Settings, refresh: Optional[Callable[[List[str]], Iterable]] = None,
                 states: Optional[StateReader] = None, now: Callable[[], datetime] = lambda: datetime.now(timezone.utc),
                 ledger: Optional[LedgerReader] = None) -> None:
        self.app = app
        self.settings = settings
        #: Reads ledger rows for entries whose task uses the ledger (``ClaimStore.run_states``); without
        #: it those entries are read from the result backend like any other.
        self.ledger = ledger
        #: task name -> whether it uses the ledger (asked of the app once per task).
        self._ledger_tasks: Dict[str, bool] = {}
        #: The scheduler's clock (the database's, corrected for this host's offset): a run's age
        #: is compared with times from the store, so it must be measured on the same clock.
        self.now = now
        #: Where task states come from; the result backend unless a test or another source says otherwise.
        self.states: StateReader = states if states is not None else ResultBackendStates(app)
        #: Without a lease every replica may send any fire, so before deciding, the guard re-reads
        #: the last sent run of the due schedules from the store (``ClaimStore.schedule_states``).
        self.refresh = refresh
        self._last: Dict[str, _LastRun] = {}
        self._ignoring: Dict[Tuple[str, bool], bool] = {}
        self._buffer: Dict[str, Pair] = {}
        self._next_poll = 0.0

    def uses_ledger(self, entry: Entry) -> bool:
        """Whether *entry*'s runs are read from the ledger (its task uses it and a reader is injected)."""
        if self.ledger is None:
            return False
        known = self._ledger_tasks.get(entry.task)
        if known is None:
            known = self._ledger_tasks[entry.task] = uses_ledger(self.app, entry.task)
        return known

    def policy(self, entry: Entry) -> OverlapPolicy:
        """The entry's effective policy: an explicit one as written; the default guards only what it sees."""
        if entry.overlap:
            return entry.overlap
        if self.settings.overlap_explicit:
            return self.settings.overlap
        if self.uses_ledger(entry):
            return OverlapPolicy.SKIP  # the ledger sees every run, result backend or not
        if self.settings.overlap != OverlapPolicy.ALLOW and self._ignores_results(entry):
            return OverlapPolicy.ALLOW  # its state stays PENDING: guarding it would drop runs silently
        return self.settings.overlap

    def _ignores_results(self, entry: Entry) -> bool:
        """:func:`ignores_results`, read once per task (it reads the app's settings: 20,000
        entries of one task are one read)."""
        key = (entry.task, bool(entry.options.get("ignore_result")))
        known = self._ignoring.get(key)
        if known is None:
            known = self._ignoring[key] = ignores_results(self.app, entry)
        return known

    def max_run_time(self, entry: Entry) -> float:
        return entry.max_run_time if entry.max_run_time is not None else self.settings.max_run_time

    # -- start-up ------------------------------------------------------------------
    def warn_about_configuration(self, entries: Iterable[Entry]) -> None:
        """Say clearly when a guard policy cannot see what it needs to."""
        entries = list(entries)
        # Left unguarded by the default (README: Overlapping runs): no policy of its own, none set
        # globally, and the default could not observe its runs (no result backend, or the task
        # ignores its results). Said once, naming them, also when the default is allow for all.
        unguarded = sorted(e.name for e in entries if not e.overlap and not self.settings.overlap_explicit
                           and self.policy(e) == OverlapPolicy.ALLOW)
        if unguarded:
            shown = unguarded[:UNGUARDED_NAMED]
            names = ", ".join(shown) + (f" and {len(unguarded) - len(shown)} more" if len(unguarded) > len(shown)
                                        else "")
            why = ("the task ignores its results, so the result backend cannot say when a run ends"
                   if self.settings.overlap != OverlapPolicy.ALLOW else
                   "the app has no result backend, so nothing says when a run ends")
            logger.warning(
                "cluster-beat: overlap guard off for %s: %s and runs may overlap. Use "
                "base=celery_cluster_beat.LedgerTask for the task to guard it%s, or set overlap='allow' on the "
                "entry (or cluster_beat_overlap='allow') to silence this.", names, why,
                "" if self.settings.overlap != OverlapPolicy.ALLOW else " (or configure result_backend)")
        guarded = sorted(e.name for e in entries if self.policy(e) != OverlapPolicy.ALLOW and not self.uses_ledger(e))
        if not guarded:
            return
        names = ", ".join(guarded[:5]) + (" ..." if len(guarded) > 5 else "")
        if not has_result_backend(self.app):
            logger.warning(
                "cluster-beat: overlap guard on %s but the app has no result backend: every run looks PENDING, "
                "so each blocks the next one for max_run_time (%gs) whether it finished or not. "
                "Configure result_backend, or set overlap='allow'.", names, self.settings.max_run_time)
        elif not self.app.conf.task_track_started:
            logger.warning(
                "cluster-beat: overlap guard on %s with task_track_started=False: a running task is stored "
                "as PENDING, not STARTED, so it counts as in flight only until max_run_time (%gs). "
                "Set task_track_started=True for the guard to see long runs.", names, self.settings.max_run_time)

    def load(self, states) -> None:
        """Adopt the last sent run of each schedule from the store (a new leader inherits them)."""
        for st in states:
            if st.last_task_id and st.last_sent_at is not None:
                at = getattr(st, "last_sent_occurrence", None)
                current = self._last.get(st.name)
                if current is None or current.older_than(at, st.last_sent_at):
                    self._last[st.name] = _LastRun(st.last_task_id, st.last_sent_at, at)

    def sent(self, entry: Entry, occ: Occurrence) -> None:
        """A run of *occ* went out. A resend of an older occurrence does not become the last run:
        the guard keeps watching the newest one."""
        now = self.now()
        current = self._last.get(entry.name)
        if current is None or current.task_id == occ.task_id or current.older_than(occ.at, now):
            self._last[entry.name] = _LastRun(occ.task_id, now, occ.at)

    def _assess(self, entry: Entry, last: Optional[_LastRun], state: Optional[str], now: datetime) -> Verdict:
        if last is None or state is None or state in FINISHED:
            return FREE
        age = (now - last.sent_at).total_seconds()
        limit = self.max_run_time(entry)
        if age < limit:
            return BUSY  # PENDING (young), RECEIVED, STARTED, RETRY or a custom progress state
        if state == celery_states.PENDING:
            # Unknown and old: the result expired or was never stored (ignore_result, no
            # task_track_started): nothing says it still runs.
            logger.debug("cluster-beat: %s: previous run %s is PENDING after %.0fs; treated as finished",
                         entry.name, last.task_id, age)
            return FREE
        return self._overdue(entry, last, state, age, limit)

    def _assess_ledger(self, entry: Entry, last: Optional[_LastRun], row: Optional[LedgerState],
                       now: datetime) -> Verdict:
        """The verdict from the last run's ledger row (see the module docstring)."""
        if last is None or row is None or row.run_state in LEDGER_FINISHED:
            return FREE
        if row.run_state is None and row.status in NOT_SENT:
            # Never went out, as far as anyone knows. (A 'failed' publish may still have reached a
            # worker; once it starts, its run state says so and counts above this.)
            return FREE
        limit = self.max_run_time(entry)
        if row.run_state is None:  # sent (or about to be), not started: queued, or lost on the way
            since = row.sent_at or last.sent_at
            age = (now - since).total_seconds()
            return BUSY if age < limit else FREE
        # running, or retried (Celery will deliver the retry): in flight since the last start
        age = (now - (row.started_at or last.sent_at)).total_seconds()
        if age < limit:
            return BUSY
        return self._overdue(entry, last, str(row.run_state), age, limit)

    def _overdue(self, entry: Entry, last: _LastRun, state: str, age: float, limit: float) -> Verdict:
        if not last.watchdog_fired:
            last.watchdog_fired = True
            logger.warning("cluster-beat: watchdog: %s: previous run %s is still %s after %.0fs "
                           "(max_run_time %gs); no longer blocking the schedule",
                           entry.name, last.task_id, state, age, limit)
            signals.watchdog_fired.send(sender=self, schedule=entry.name, task_id=last.task_id, age=age)
        return OVERDUE

    def filter(self, candidates: Sequence[Pair], now: datetime) -> GuardDecision:
        """Split due occurrences into send / skip / buffer (one state read for all)."""
        decision = GuardDecision()
        guarded = [(e, o) for e, o in candidates if self.policy(e) != OverlapPolicy.ALLOW]
        if not guarded:
            decision.send = list(candidates)
            return decision
        if self.refresh is not None:  # may raise the store's error: the caller retries the whole batch
            self.load(self.refresh(sorted({e.name for e, _ in guarded})))
        by_ledger = {e.name for e, _ in guarded if self._reads_ledger(e)}
        states = self.states(sorted({self._last[e.name].task_id for e, _ in guarded
                                     if e.name in self._last and e.name not in by_ledger}))
        # May raise the store's error too: the caller retries the whole batch.
        rows = self._ledger_rows(by_ledger)
        verdicts: Dict[str, Verdict] = {}
        taken: set = set()  # entries with an occurrence already sent in this batch
        for entry, occ in candidates:
            policy = self.policy(entry)
            if policy == OverlapPolicy.ALLOW:
                decision.send.append((entry, occ))
                continue
            name = entry.name
            last = self._last.get(name)
            if name not in verdicts:
                if name in by_ledger:
                    verdicts[name] = self._assess_ledger(entry, last, rows.get(self._key(name)), now)
                else:
                    verdicts[name] = self._assess(entry, last, states.get(last.task_id) if last else None, now)
            verdict = verdicts[name]
            if name in taken:
                # Catch-up sends several at once: the guard lets the first through only.
                verdict = BUSY
            elif name in self._buffer:
                if self._buffer[name][1] == occ:  # this very occurrence, back after a failed pass
                    decision.buffered.append((entry, occ))
                    continue
                verdict = BUSY  # an earlier occurrence waits in the buffer and goes first
            if policy == OverlapPolicy.REPLACE and name not in taken and verdict != FREE:
                taken.add(name)
                decision.replaces[occ] = last.task_id
                decision.send.append((entry, occ))
            elif verdict != BUSY:
                taken.add(name)
                decision.send.append((entry, occ))
            elif policy == OverlapPolicy.BUFFER_ONE and name not in self._buffer:
                self._buffer[name] = (entry, occ)
                decision.buffered.append((entry, occ))
            else:
                decision.skipped.append((entry, occ))
        return decision

    # -- buffer_one --------------------------------------------------------------------
    def is_buffered(self, name: str) -> bool:
        return name in self._buffer

    def has_buffered(self) -> bool:
        return bool(self._buffer) and time.monotonic() >= self._next_poll

    def next_check_in(self) -> Optional[float]:
        if not self._buffer:
            return None
        return max(0.0, self._next_poll - time.monotonic())

    def ready(self, now: datetime) -> List[Pair]:
        """Buffered occurrences whose previous run has finished (or timed out)."""
        self._next_poll = time.monotonic() + BUFFER_POLL
        if not self._buffer:
            return []
        by_ledger = {name for name, (entry, _) in self._buffer.items() if self._reads_ledger(entry)}
        ids = sorted({self._last[name].task_id for name in self._buffer if name in self._last and name not in by_ledger})
        states = self.states(ids)
        try:
            rows = self._ledger_rows(by_ledger)
        except StoreUnavailable as exc:  # cannot tell: the buffered ones wait for the next poll
            logger.warning("cluster-beat: cannot read the ledger for buffered runs (%s); they wait", exc)
            return []
        out: List[Pair] = []
        for name, (entry, occ) in list(self._buffer.items()):
            last = self._last.get(name)
            if name in by_ledger:
                verdict = self._assess_ledger(entry, last, rows.get(self._key(name)), now)
            else:
                verdict = self._assess(entry, last, states.get(last.task_id) if last else None, now)
            if verdict != BUSY:
                del self._buffer[name]
                out.append((entry, occ))
        return out

    def _reads_ledger(self, entry: Entry) -> bool:
        """Whether this entry's last run is judged from the ledger: it uses it and the instant of
        its last run is known (a run recorded before instants were kept is read the old way)."""
        last = self._last.get(entry.name)
        return self.uses_ledger(entry) and (last is None or last.at is not None)

    def _key(self, name: str) -> Optional[Tuple[str, datetime]]:
        last = self._last.get(name)
        return (name, last.at) if last is not None and last.at is not None else None

    def _ledger_rows(self, names: Iterable[str]) -> Dict[Tuple[str, datetime], LedgerState]:
        keys = sorted({k for k in (self._key(n) for n in names) if k is not None})
        if not keys or self.ledger is None:
            return {}
        return self.ledger(keys)

    def forget_runs(self, names: Iterable[str]) -> None:
        """Stop keeping the last runs of *names*: their schedules are no longer held (SQL keeps the
        last run; :meth:`load` brings it back when they are). A buffered occurrence keeps its own."""
        for name in names:
            if name not in self._buffer:
                self._last.pop(name, None)

    def retain_runs(self, keep: Callable[[str], bool]) -> None:
        """Keep only the last runs of the schedules *keep* says are held (and of buffered ones)."""
        self.forget_runs([name for name in self._last if not keep(name)])

    def kept_runs(self) -> int:
        """How many schedules' last runs are kept in memory."""
        return len(self._last)

    def requeue(self, pairs: Sequence[Pair]) -> None:
        """Put back buffered occurrences that :meth:`ready` handed out but could not be claimed
        (the store failed): they wait for the next try, not lost."""
        for entry, occ in pairs:
            self._buffer.setdefault(entry.name, (entry, occ))

    def forget(self, name: str) -> Optional[Pair]:
        """Drop the buffered occurrence of *name* (its schedule changed or went away); it, or None."""
        return self._buffer.pop(name, None)

    def drop_buffered(self) -> List[Pair]:
        """Hand back and forget the buffered occurrences (this node stopped scheduling)."""
        pairs = list(self._buffer.values())
        self._buffer.clear()
        return pairs

    def revoke(self, task_id: str) -> None:
        """Terminate the run being replaced (``replace`` policy)."""
        try:
            self.app.control.revoke(task_id, terminate=True)
        except Exception as exc:
            logger.error("cluster-beat: revoking %s failed: %r", task_id, exc)
