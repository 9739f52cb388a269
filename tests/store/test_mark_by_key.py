"""'Sent' marks and confirmations find their rows by key, whatever else updates the rows meanwhile.

The worker's ledger updates a claim row's run columns (``start_run``) a few
milliseconds after the message lands, which is exactly when beat marks the row
``sent``. A mark (or a confirmation) that then waits for the ledger's row lock
must still change the row once the ledger commits: a row it skipped would stay
``claimed``, and the stale-claim sweep would resend the very message this live
node had just published (same task id), saying a node stopped though none did.

Every test runs against a SQLite file, a real PostgreSQL and a real MariaDB. The
concurrent update is held open in a transaction of its own while the store's
call runs in a thread; on the two servers the test waits until the store's
statement is seen waiting for that row lock, then commits. SQLite has one writer
at a time: there the store's transaction waits (busy timeout) for the other
writer's commit and then runs, which is the same order of events.
"""
from __future__ import annotations

import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Any, Callable, List

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.store import ClaimStore
from celery_cluster_beat.store.schema import claims_table

UTC = timezone.utc
T0 = datetime(2021, 1, 1, tzinfo=UTC)  # in the past: a sweep may take a stale claim at once
NAMES = [f"s{i}" for i in range(5)]
HELD = "s2"  # the row the "ledger" updates while beat marks it


def _occurrences() -> List[Occurrence]:
    return [Occurrence(name, T0) for name in NAMES]


def _lock_waits(raw: sa.engine.Engine) -> int:
    """How many sessions of the test's database wait for a row lock now (servers only)."""
    kind = make_url(str(raw.url)).get_backend_name()
    with raw.connect() as conn:
        if kind == "postgresql":
            return conn.exec_driver_sql(
                "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                "AND wait_event_type = 'Lock'").scalar_one()
        # MariaDB: an UPDATE of the five-row claim table still running after 0.3 s waits for the
        # row lock. (information_schema.innodb_trx, a cache, was seen to miss such a wait for
        # seconds while other sessions of the server were busy.)
        return conn.exec_driver_sql(
            "SELECT count(*) FROM information_schema.processlist WHERE db = DATABASE() "
            "AND command = 'Query' AND info LIKE 'UPDATE cluster_beat_claims%%' AND time_ms >= 300").scalar_one()


def _during_ledger_update(raw: sa.engine.Engine, call: Callable[[], Any]) -> Any:
    """Run *call* in a thread while another transaction holds an update of HELD's run columns
    (the shape of the ledger's ``start_run``), commit that update once *call* waits for it;
    *call*'s result."""
    c = claims_table
    kind = make_url(str(raw.url)).get_backend_name()
    out: dict = {}

    def run() -> None:
        try:
            out["result"] = call()
        except BaseException as exc:  # reported by the test thread
            out["error"] = exc

    thread = threading.Thread(target=run, name="store-call")
    with raw.connect() as conn:
        tx = conn.begin()
        changed = conn.execute(
            sa.update(c)
            .where(c.c.schedule == HELD, c.c.scheduled_at == T0, c.c.run_state.is_(None))
            .values(run_state="running", run_token="0000-t", worker="celery@w1", worker_pid=4242,
                    started_at=T0, finished_at=None, runtime=None, run_error=None)
        ).rowcount
        assert changed == 1
        thread.start()
        if kind == "sqlite":
            # One writer at a time: the store's write transaction cannot begin before this commit.
            time.sleep(0.5)
            assert thread.is_alive(), "the store's call did not wait for the open write transaction"
        else:
            deadline = time.monotonic() + 30
            while _lock_waits(raw) < 1:
                assert thread.is_alive(), f"the store's call ended without waiting for the row lock: {out}"
                assert time.monotonic() < deadline, "the store's call never waited for the row lock"
                time.sleep(0.05)
            time.sleep(0.2)  # well inside the store's lock wait
        tx.commit()
    thread.join(60)
    assert not thread.is_alive()
    if "error" in out:
        raise out["error"]
    return out["result"]


def _rows(raw: sa.engine.Engine) -> dict:
    c = claims_table
    with raw.connect() as conn:
        return {r.schedule: r for r in conn.execute(sa.select(c.c.schedule, c.c.status, c.c.node, c.c.run_state,
                                                               c.c.attempts))}


@pytest.fixture
def stores(db_url):
    made: List[ClaimStore] = []

    def make(node: str) -> ClaimStore:
        store = ClaimStore(db_url, node_id=node, lock_timeout=30)
        store.open()
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()


@pytest.mark.timeout(120)
def test_confirm_and_mark_sent_change_a_row_the_ledger_updates_meanwhile_and_no_sweep_resends_it(
        stores, raw):
    """A claimed row whose run columns another transaction updates while ``confirm`` and then
    ``mark_sent`` wait for its lock is confirmed (returned as still ours) and marked ``sent``
    like its neighbours, with the other transaction's run state kept; afterwards another
    node's sweep, run with the claimant looking gone, adopts nothing.

    How it fails: a statement that finds its rows by a physical row id (PostgreSQL's ctid)
    loses the row once the concurrent update gives it a new version: confirm leaves it out
    (beat would not publish it) and mark_sent leaves it ``claimed``, so the sweep adopts it
    and its message is sent a second time.
    """
    a, b = stores("node-a"), stores("node-b")
    occs = _occurrences()
    assert a.claim(occs, term=1) == occs

    confirmed = _during_ledger_update(raw, lambda: a.confirm(occs, term=1))
    assert confirmed == occs, "confirm lost a row the ledger updated meanwhile"

    # The ledger's update is committed now; a second one is held during the mark.
    c = claims_table
    with raw.begin() as conn:
        conn.execute(sa.update(c).where(c.c.schedule == HELD).values(run_state=None))
    marked = _during_ledger_update(raw, lambda: a.mark_sent(occs))
    assert marked == len(NAMES), "mark_sent skipped a row the ledger updated meanwhile"
    rows = _rows(raw)
    assert {n: (r.status, r.node) for n, r in rows.items()} == {n: ("sent", "node-a") for n in NAMES}
    assert rows[HELD].run_state == "running", "the ledger's update was overwritten"
    assert all(r.attempts == 1 for r in rows.values())
    assert {s.name: s.sent for s in a.schedule_states()} == {n: 1 for n in NAMES}

    # Node a never heartbeated (it looks gone) and its claims are past a tiny grace: any row it
    # had left 'claimed' would be adopted now, and resent.
    time.sleep(0.3)
    assert b.take_over_stale(0.1, term=2) == []
    assert {r.status for r in _rows(raw).values()} == {"sent"}


@pytest.mark.timeout(120)
def test_a_row_taken_over_while_the_mark_waits_is_not_marked_by_its_old_claimant(stores, raw):
    """The other half of matching by key *and owner*: when the transaction the mark waits for
    hands the row to another node (a sweep's adoption: node and claim time change), the old
    claimant's mark and confirmation leave it alone, and report only the rows still theirs."""
    a = stores("node-a")
    occs = _occurrences()
    assert a.claim(occs, term=1) == occs
    c = claims_table
    kind = make_url(str(raw.url)).get_backend_name()

    for call in (lambda: a.confirm(occs, term=1), lambda: a.mark_sent(occs)):
        out: dict = {}
        thread = threading.Thread(target=lambda: out.setdefault("result", call()))
        with raw.connect() as conn:
            tx = conn.begin()
            assert conn.execute(sa.update(c).where(c.c.schedule == HELD, c.c.node == "node-a")
                                .values(node="node-b", claimed_at=T0 + timedelta(hours=1))).rowcount == 1
            thread.start()
            if kind == "sqlite":
                time.sleep(0.5)
            else:
                deadline = time.monotonic() + 30
                while _lock_waits(raw) < 1 and thread.is_alive():
                    assert time.monotonic() < deadline, "the store's call never waited for the row lock"
                    time.sleep(0.05)
            tx.commit()
        thread.join(60)
        result = out["result"]
        if isinstance(result, list):
            assert result == [o for o in occs if o.schedule != HELD]
        else:
            assert result == len(NAMES) - 1
        with raw.begin() as conn:  # back to a for the next call
            conn.execute(sa.update(c).where(c.c.schedule == HELD).values(node="node-a"))
    rows = _rows(raw)
    assert rows[HELD].status == "claimed"
    assert {n for n, r in rows.items() if r.status == "sent"} == set(NAMES) - {HELD}
