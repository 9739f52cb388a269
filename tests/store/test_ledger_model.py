"""A stateful property test of the ledger against a model: deliveries, duplicates, retries, check
copies, finishes and worker deaths in random order, on a real (SQLite) store.

The model is the rule book of store/ledger.py in a few lines. Deaths are real by the database's
clock: a process dies silently by writing its last heartbeat with a tiny grace and letting it
expire, or is recorded gone by its worker's main process (lost with a requeue, or failed).
Invariants: never two live runs of one occurrence (a run starts only when no live process
holds it), and a dead run is re-run at most once per death.
"""
from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Dict, List, Optional

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from celery_cluster_beat.store import ClaimStore
from celery_cluster_beat.store.ledger import StartOutcome
from celery_cluster_beat.store.schema import RunState

AT = datetime(2022, 1, 1, tzinfo=timezone.utc)  # in the past: the ledger refuses an instant ahead of the database's clock
NAME = "modelled"
LIVE = 120.0
LAST_BEAT = 0.02  # the grace of a dying process's last heartbeat
S, C, R, D = StartOutcome.STARTED, StartOutcome.CONTINUED, StartOutcome.RERUN, StartOutcome.DUPLICATE


def proc(pid: int) -> str:
    return f"host:{pid}:x"


@dataclass
class Model:
    state: Optional[str] = None  # a RunState value
    holder: Optional[int] = None  # pid of the process holding the run
    token: Optional[str] = None
    attempt: int = 0
    pending: Optional[str] = None  # the check copy's id
    old_checks: List[str] = field(default_factory=list)
    alive: Dict[int, bool] = field(default_factory=dict)
    deaths: int = 0  # deaths of a process while it held a running run
    reruns: int = 0
    starts: int = 0


class LedgerMachine(RuleBasedStateMachine):
    @initialize()
    def open_store(self) -> None:
        self.dir = tempfile.TemporaryDirectory()
        self.store = ClaimStore(f"sqlite:///{Path(self.dir.name) / 'ledger.sqlite3'}", node_id="model")
        self.store.open()
        self.m = Model()
        self.next_pid = 1
        for _ in range(2):
            self.new_process()

    def teardown(self) -> None:
        store = getattr(self, "store", None)
        if store is not None:
            store.close()
            self.dir.cleanup()

    def live(self) -> List[int]:
        return [p for p, ok in self.m.alive.items() if ok]

    @rule()
    def new_process(self) -> None:
        pid = self.next_pid
        self.next_pid += 1
        assert self.store.worker_heartbeat(proc(pid), host="host", pid=pid, grace=LIVE)
        self.m.alive[pid] = True

    def expected(self, retries: int, takeover: bool, check: Optional[str]) -> StartOutcome:
        m = self.m
        if m.state is None:
            return S
        if retries > 0 and m.state in ("retried", "running", "lost") and m.attempt < retries:
            return C
        holder_dead = m.state == "running" and not m.alive.get(m.holder or 0, False)
        if takeover and m.attempt <= retries and (m.state == "lost" or holder_dead):
            return R
        return D

    @precondition(lambda self: any(self.m.alive.values()))
    @rule(data=st.data(), retry_step=st.sampled_from([0, 0, 1, -1]), takeover=st.booleans(),
          copy=st.sampled_from(["none", "pending", "old"]))
    def deliver(self, data, retry_step: int, takeover: bool, copy: str) -> None:
        m = self.m
        pid = data.draw(st.sampled_from(self.live()))
        retries = max(0, m.attempt + retry_step) if m.state is not None else 0
        check = {"none": None, "pending": m.pending, "old": m.old_checks[-1] if m.old_checks else None}[copy]
        want = self.expected(retries, takeover, check)
        holder_alive = m.state == "running" and m.alive.get(m.holder or 0, False)
        got = self.store.start_run(NAME, AT, task_id="t" * 36, worker=f"w{pid}", pid=pid, retries=retries,
                                   process=proc(pid), grace=LIVE, takeover=takeover, check=check)
        assert got.outcome is want, (got, m, retries, takeover, check)
        if want is D:
            may_check = takeover and holder_alive and (m.pending is None or (check is not None and check == m.pending))
            assert (got.check_token is not None) == may_check, (got, m, check)
            if got.check_token is not None:
                if m.pending:
                    m.old_checks.append(m.pending)
                m.pending = got.check_token
            return
        # This delivery runs the body: nobody else may hold a live run of the occurrence.
        assert not holder_alive or want is C
        if want is R:
            m.reruns += 1
        if want is S:
            m.starts += 1
        if m.pending:
            m.old_checks.append(m.pending)
        m.state, m.holder, m.token, m.attempt, m.pending = "running", pid, got.token, retries, None

    @precondition(lambda self: self.m.state == "running" and self.m.alive.get(self.m.holder or 0, False))
    @rule(end=st.sampled_from([RunState.SUCCEEDED, RunState.FAILED, RunState.RETRIED]))
    def finish(self, end: RunState) -> None:
        m = self.m
        assert self.store.finish_run(NAME, AT, m.token, end, 0.1)
        m.state, m.pending = end.value, None if end is not RunState.RETRIED else m.pending

    @precondition(lambda self: any(self.m.alive.values()))
    @rule(data=st.data())
    def die_silently(self, data) -> None:
        """The process stops heartbeating (host lost, frozen): dead once its last grace passes."""
        pid = data.draw(st.sampled_from(self.live()))
        self.store.worker_heartbeat(proc(pid), host="host", pid=pid, grace=LAST_BEAT)
        time.sleep(LAST_BEAT * 3)
        self._died(pid)

    @precondition(lambda self: any(self.m.alive.values()))
    @rule(data=st.data(), requeued=st.booleans())
    def pool_child_lost(self, data, requeued: bool) -> None:
        """Its worker's main process records the loss: lost (message requeued) or failed."""
        m = self.m
        pid = data.draw(st.sampled_from(self.live()))
        holds = m.state == "running" and m.holder == pid
        state = RunState.LOST if requeued else RunState.FAILED
        changed = self.store.end_lost_run(NAME, AT, host="host", pid=pid, state=state, error="WorkerLostError: x")
        assert changed == holds
        # Only the process the run's row names is recorded gone by the main process; another dead
        # child's row would expire: the model records it gone at once.
        if holds:
            assert not self.store.worker_alive(proc(pid))
        else:
            self.store.worker_gone(proc(pid), reason="died")
        self._died(pid)
        if holds:
            m.state = state.value

    def _died(self, pid: int) -> None:
        m = self.m
        m.alive[pid] = False
        if m.state == "running" and m.holder == pid:
            m.deaths += 1

    @invariant()
    def one_live_run_and_rerun_once_per_death(self) -> None:
        m = getattr(self, "m", None)
        if m is None:
            return
        assert m.starts <= 1
        assert m.reruns <= m.deaths
        rows = [r for r in self.store.claims(NAME) if r.scheduled_at == AT]
        if m.state is None:
            assert rows == []
            return
        [r] = rows
        assert r.run_state == m.state and r.run_attempt == m.attempt
        assert r.run_process == proc(m.holder)


LedgerMachine.TestCase.settings = settings(
    max_examples=15, stateful_step_count=20, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
test_ledger_against_its_model = pytest.mark.timeout(120)(LedgerMachine.TestCase)
