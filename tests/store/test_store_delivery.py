"""The claim store's delivery guarantees: fencing, claim tokens, takeover of
gone claimants, the database's clock, the last run, migrations and pruning.

Every test runs against a SQLite file, a real PostgreSQL and a real MariaDB
(the ``db_url`` fixture gives each test an empty database of its own) unless
it says otherwise. Nothing about claims, locks or the ledger is mocked: the
stores are real and so are the rows they write; a test sets up history by
writing rows the way an older release or another node would.

Times: where a claimant must look "alive" the test heartbeats right before
the sweep and gives it a grace of seconds, and where it must look "gone" the
test sleeps well past a grace of a fraction of that; no bound depends on a
tight window.
"""
from __future__ import annotations

import threading
import time
import uuid
from datetime import datetime, timedelta, timezone
from typing import Dict, List

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.store import SCHEMA_VERSION, ClaimStore, StaleTermError
from celery_cluster_beat.store.schema import (
    claims_table,
    leader_table,
    meta_table,
    metadata,
    nodes_table,
    schedules_table,
)

UTC = timezone.utc
T0 = datetime(2021, 1, 1, tzinfo=UTC)  # in the past: a stale claim is taken over only after its instant


def occ(name: str, minute: int) -> Occurrence:
    return Occurrence(name, T0 + timedelta(minutes=minute))


def keys(occurrences) -> List[tuple]:
    return sorted((o.schedule, o.at) for o in occurrences)


def dialect_of(url: str) -> str:
    return make_url(url).get_backend_name()


def states(store: ClaimStore) -> Dict[str, object]:
    return {s.name: s for s in store.schedule_states()}


def leader_row(raw):
    with raw.connect() as conn:
        return conn.execute(sa.select(leader_table.c.term, leader_table.c.node)).one()


# --------------------------------------------------------------------------- 2. the fence


def test_an_equal_term_recorded_by_another_node_is_refused_the_recording_node_may_go_on(make_store, raw):
    """Two nodes holding "the same" term (two leases over one store) are not both
    admitted: the node that recorded term 7 claims again with 7; another node
    presenting 7 is refused (StaleTermError, nothing written: no row, no
    counter) by claim, record, take_over_stale and confirm alike. A higher term
    passes, and then the first node's 7 is stale too.

    Fails if the fence compares ``term <= :term`` without the node (both admitted).
    """
    a, b = make_store("node-a"), make_store("node-b")
    assert a.claim([occ("x", 1)], term=7) == [occ("x", 1)]
    assert tuple(leader_row(raw)) == (7, "node-a")

    with pytest.raises(StaleTermError) as info:
        b.claim([occ("x", 2), occ("y", 2)], term=7)
    assert (info.value.seen_term, info.value.term) == (7, 7)
    with pytest.raises(StaleTermError):
        b.record([occ("x", 3)], status="skipped", reason="overlap", term=7)
    with pytest.raises(StaleTermError):
        b.take_over_stale(0, term=7)
    with pytest.raises(StaleTermError):
        b.confirm([occ("x", 1)], term=7)
    assert keys(r.occurrence for r in a.claims()) == keys([occ("x", 1)])
    assert "y" not in states(a) and states(a)["x"].claim_lost == 0  # the refused calls counted nothing
    assert tuple(leader_row(raw)) == (7, "node-a")

    # The node that recorded the term goes on with it.
    assert a.claim([occ("x", 2)], term=7) == [occ("x", 2)]
    assert a.confirm([occ("x", 1), occ("x", 2)], term=7) == [occ("x", 1), occ("x", 2)]
    # A newer term wins the row; from then on 8 is b's and a's 8 is refused.
    assert b.claim([occ("x", 3)], term=8) == [occ("x", 3)]
    with pytest.raises(StaleTermError) as info:
        a.claim([occ("x", 4)], term=8)
    assert (info.value.seen_term, info.value.term) == (8, 8)
    assert b.claim([occ("x", 4)], term=8) == [occ("x", 4)]
    assert tuple(leader_row(raw)) == (8, "node-b")
    assert [(r.node, r.term) for r in a.claims()] == [("node-a", 7), ("node-a", 7), ("node-b", 8), ("node-b", 8)]


# --------------------------------------------------------------------------- 3. claim tokens


def test_a_claim_retried_with_its_token_and_resume_wins_what_the_lost_attempt_wrote(make_store):
    """A claim whose commit succeeded but whose reply was lost is retried with the
    same token and ``resume=True``: the rows the first attempt wrote come back as
    won (together with any new occurrence), not as "claimed by another node", and
    claim_lost does not move. Another node, with its own token, wins nothing even
    with resume; the same node without resume counts them as lost; a row taken
    over meanwhile (its op_token rewritten) is not won back by resuming.

    Fails if resume ignored the token (the retry would win nothing and the
    occurrences would never be sent) or matched rows by node only.
    """
    a, b = make_store("node-a"), make_store("node-b")
    first = [occ("s", 1), occ("t", 1)]
    token = uuid.uuid4().hex
    assert a.claim(first, token=token) == first  # committed; pretend the reply was lost

    retry = first + [occ("s", 2)]
    assert a.claim(retry, token=token, resume=True) == retry
    assert {n: st.claim_lost for n, st in states(a).items()} == {"s": 0, "t": 0}
    assert [(r.node, r.status) for r in a.claims()] == [("node-a", "claimed")] * 3

    assert b.claim(retry, token=uuid.uuid4().hex, resume=True) == []
    assert {n: st.claim_lost for n, st in states(a).items()} == {"s": 2, "t": 1}
    assert a.claim(retry, token=token) == []  # no resume: rows of a former call are lost
    assert {n: st.claim_lost for n, st in states(a).items()} == {"s": 4, "t": 2}
    assert {r.node for r in a.claims()} == {"node-a"}

    # Rows taken over after the lost reply are not won back by resuming.
    token2 = uuid.uuid4().hex
    later = [occ("s", 10), occ("t", 10)]
    assert a.claim(later, token=token2) == later
    assert a.release() == 5  # every claimed row of a (first, s2 and later) is handed over
    assert keys(b.take_over_stale(3600)) == keys(retry + later)
    assert a.claim(later, token=token2, resume=True) == []
    assert {r.node for r in a.claims()} == {"node-b"}


# --------------------------------------------------------------------------- 4. takeover of gone claimants


def test_a_claimant_that_heartbeats_keeps_its_rows_until_its_heartbeat_is_older_than_the_grace(make_store):
    """Rows older than the grace stay with a claimant whose heartbeat is fresh:
    another node's take_over_stale returns nothing (and the claimant can still
    confirm and mark them). Once its heartbeat is older than the grace, the
    sweeper takes every one of them, with their task ids, and the old claimant
    can neither confirm nor mark them any more.

    Fails if staleness were judged by the claim's age alone (first sweep would
    take the rows) or if the heartbeat were ignored altogether.
    """
    alive, sweeper = make_store("node-alive"), make_store("node-sweeper")
    alive.heartbeat(scheduling=True, register=True)
    sweeper.heartbeat(scheduling=True, register=True)
    rows = [occ(f"s{i}", i) for i in range(5)]
    assert alive.claim(rows) == rows
    time.sleep(3.0)  # the rows are now >= 3 s old

    alive.heartbeat(scheduling=True)
    # Grace 2.5 s: the rows are older; the heartbeat is not, unless the host stalls
    # 2.5 s between the two statements.
    assert sweeper.take_over_stale(2.5) == []
    assert alive.confirm(rows) == rows  # still its own (and refreshed)

    time.sleep(1.0)  # no heartbeat for >= 1 s: gone, for a grace of 0.5 s
    taken = sweeper.take_over_stale(0.5)
    assert keys(taken) == keys(rows)
    assert {o.task_id for o in taken} == {o.task_id for o in rows}
    assert alive.confirm(rows) == [] and alive.mark_sent(rows) == 0
    assert {r.node for r in alive.claims()} == {"node-sweeper"}
    assert sweeper.mark_sent(taken) == len(rows)


def test_a_re_registered_node_loses_the_claims_of_its_previous_incarnation_only(make_store):
    """``heartbeat(register=True)`` starts a new incarnation: the claims the node
    made before it belong to a stopped process and are taken over (once older
    than the grace) although the node's heartbeat is fresh; the claims it made
    since stay its own. ``confirm()`` then returns to each node only the rows
    still its own.

    Fails if registering did not move started_at (nothing taken: the old
    incarnation's claims would never be sent) or if it counted for later claims.
    """
    node, sweeper = make_store("node-a"), make_store("node-b")
    node.heartbeat(scheduling=True, register=True)
    before = [occ("s", i) for i in range(3)]
    assert node.claim(before) == before
    node.heartbeat(scheduling=True, register=True)  # the process restarted under the same node id
    after = [occ("s", 10 + i) for i in range(3)]
    assert node.claim(after) == after
    time.sleep(3.0)  # every row is now >= 3 s old

    node.heartbeat(scheduling=True)  # alive (fresh for a grace of 2 s)
    taken = sweeper.take_over_stale(2.0)
    assert keys(taken) == keys(before)
    assert node.confirm(before + after) == after
    assert sweeper.confirm(before + after) == before
    nodes = {n.node: n for n in node.nodes()}
    assert set(nodes) == {"node-a"}  # the sweeper never heartbeated: it only reads
    assert nodes["node-a"].started_at < nodes["node-a"].heartbeat_at


def test_a_claim_made_ahead_of_its_instant_and_handed_over_is_not_taken_before_the_instant(make_store):
    """The leader claims a burst a moment before its instant and publishes at the instant. If it
    stops in between, the rows it hands over must not be published early by the next sender:
    ``take_over_stale`` adopts them only once the database's clock reaches their instant.

    Fails if the sweep ignored the instant (a daily 00:00 task could run at 23:59:59.6).
    """
    a, b = make_store("node-a"), make_store("node-b")
    a.heartbeat(scheduling=True, register=True)
    db_now = b.heartbeat(scheduling=True, register=True)
    ahead = Occurrence("ahead", db_now + timedelta(seconds=2))
    due = Occurrence("due", db_now - timedelta(seconds=1))
    assert a.claim([ahead, due]) == [ahead, due]
    assert a.release() == 2
    assert keys(b.take_over_stale(3600)) == keys([due])
    deadline = time.monotonic() + 30
    taken = []
    while not taken and time.monotonic() < deadline:
        time.sleep(0.2)
        taken = b.take_over_stale(3600)
    assert keys(taken) == keys([ahead])
    assert b.heartbeat(scheduling=True) >= ahead.at


def test_release_hands_the_claims_over_at_once_and_confirm_returns_only_rows_still_ours(make_store):
    """``release()`` hands every row the node holds in ``claimed`` over (and returns
    how many): a sweeper takes them at once, with a grace of an hour and the
    releasing node's heartbeat fresh; sent rows and rows claimed after the
    release are not affected. After the takeover ``confirm()`` returns to each
    node exactly the rows it owns, and only the owner can mark them sent.

    Fails if released rows waited for the grace (the handover would take
    claim_grace), or if confirm returned rows by key regardless of owner.
    """
    a, b = make_store("node-a"), make_store("node-b")
    a.heartbeat(scheduling=True, register=True)
    handed = [occ("h", i) for i in range(4)]
    done = occ("done", 0)
    assert a.claim(handed + [done]) == handed + [done]
    assert a.mark_sent([done]) == 1

    assert a.release() == len(handed)
    assert a.confirm(handed) == []  # no longer its own, even before anyone took them
    kept = [occ("k", 0), occ("k", 1)]
    assert a.claim(kept) == kept
    a.heartbeat(scheduling=True)

    taken = b.take_over_stale(3600)
    assert keys(taken) == keys(handed)
    assert a.confirm(handed + kept) == kept
    assert b.confirm(handed + kept) == handed
    assert a.mark_sent(handed) == 0
    assert b.mark_sent(handed) == len(handed)
    assert b.take_over_stale(3600) == []
    rows = {(r.schedule, r.scheduled_at): (r.node, r.status) for r in a.claims()}
    assert rows[("done", done.at)] == ("node-a", "sent")
    assert all(rows[(o.schedule, o.at)] == ("node-b", "sent") for o in handed)
    assert all(rows[(o.schedule, o.at)] == ("node-a", "claimed") for o in kept)
    assert a.release() == len(kept)


# --------------------------------------------------------------------------- 5. the database's clock

#: The database clock runs this much *behind* the host's in the skewed stores below.
SKEW = timedelta(days=1, hours=3)


def _skewed_store(db_url: str, raw, node: str) -> ClaimStore:
    """A store whose sessions see a database clock SKEW behind this host's.

    PostgreSQL: ``clock_timestamp()`` resolved through a schema put before
    pg_catalog on the search_path; MariaDB: the session's ``timestamp``
    (frozen at that instant). The tables stay in the database's default schema.
    """
    kind = dialect_of(db_url)
    if kind == "postgresql":
        with raw.begin() as conn:
            conn.exec_driver_sql("CREATE SCHEMA IF NOT EXISTS skew")
            conn.exec_driver_sql(
                "CREATE OR REPLACE FUNCTION skew.clock_timestamp() RETURNS timestamptz LANGUAGE sql VOLATILE AS "
                f"$$ SELECT pg_catalog.clock_timestamp() - interval '{int(SKEW.total_seconds())} seconds' $$")
        connect_args = {"options": "-c search_path=public,skew,pg_catalog"}
    else:
        connect_args = {"init_command": f"SET timestamp = {time.time() - SKEW.total_seconds():.6f}"}
    store = ClaimStore(db_url, node_id=node, engine_options={"connect_args": connect_args})
    store.open()
    return store


def test_every_time_the_store_writes_is_the_databases_clock(db_url, raw):
    """claimed_at, sent_at, heartbeat_at/started_at, the schedule state's
    last_sent_at/updated_at and the leader row's updated_at all come from the
    database (``db_now()``), never from this host's clock.

    On PostgreSQL and MariaDB the database clock is made to run a day behind the
    host's, so a value taken from the host clock is a day off and fails the
    bounds; and a sweeper must judge age by that clock too: rows claimed a
    moment ago by a node that heartbeated a moment ago are not a day old. (On
    SQLite, a file with no server, the database clock *is* the host clock, by
    design: there the test checks that every value lies between two readings.)
    """
    kind = dialect_of(db_url)
    skewed = kind != "sqlite"
    make = (lambda node: _skewed_store(db_url, raw, node)) if skewed else (
        lambda node: ClaimStore(db_url, node_id=node).__enter__())
    store = make("node-a")
    sweeper = make("node-b")
    try:
        before = store.db_now()
        if skewed:
            assert abs(datetime.now(UTC) - SKEW - before) < timedelta(minutes=5), before  # the skew is in place
        beat_at = store.heartbeat(scheduling=True, register=True)
        rows = [occ("a", 1), occ("a", 2)]
        assert store.claim(rows, term=3) == rows
        assert store.mark_sent(rows[:1]) == 1
        # a sweeper that read the host clock would find these a day old
        assert sweeper.take_over_stale(3600) == []
        after = store.db_now()
        tol = timedelta(seconds=1)

        def check(what: str, value: datetime) -> None:
            assert value is not None and before - tol <= value <= after + tol, (what, value, before, after)
            if skewed:
                assert datetime.now(UTC) - value > SKEW - timedelta(hours=1), (what, value, "host clock?")

        check("heartbeat()", beat_at)
        claims = store.claims()
        for r in claims:
            check("claimed_at", r.claimed_at)
        check("sent_at", claims[0].sent_at)
        (node,) = [n for n in store.nodes() if n.node == "node-a"]
        check("started_at", node.started_at)
        check("heartbeat_at", node.heartbeat_at)
        st = states(store)["a"]
        check("last_sent_at", st.last_sent_at)
        check("updated_at", st.updated_at)
        with raw.connect() as conn:
            updated = conn.execute(sa.select(leader_table.c.updated_at)).scalar_one()
        check("leader updated_at", updated)
    finally:
        store.close()
        sweeper.close()


# --------------------------------------------------------------------------- 6. the last run only moves forward


def test_the_last_run_only_moves_forward_when_an_older_occurrence_is_marked_sent_later(make_store):
    """Marking an older occurrence sent after a newer one (a retried publish, or a
    resend by the node that took a stale claim over) counts the send but leaves
    last_task_id / last_sent_occurrence / last_sent_at at the newer run, so the
    overlap guard keeps watching the newest one. A newer send still moves them.

    Fails if mark_sent assigned the last run unconditionally.
    """
    a, b = make_store("node-a"), make_store("node-b")
    older, newer, newest = occ("job", 1), occ("job", 2), occ("job", 3)
    assert a.claim([older, newer]) == [older, newer]
    assert a.mark_sent([newer]) == 1
    at_newer = states(a)["job"]
    assert (at_newer.last_task_id, at_newer.last_sent_occurrence) == (newer.task_id, newer.at)

    time.sleep(0.05)  # a later sent_at
    assert a.mark_sent([older]) == 1  # same node, later
    st = states(a)["job"]
    assert (st.sent, st.last_task_id, st.last_sent_occurrence, st.last_sent_at) == (
        2, newer.task_id, newer.at, at_newer.last_sent_at)

    # The same through another node: a stale claim of an older occurrence resent later.
    stale = occ("job", 0)
    assert a.claim([stale]) == [stale]
    assert a.release() == 1
    assert b.take_over_stale(3600) == [stale]
    assert b.mark_sent([stale]) == 1
    st = states(a)["job"]
    assert (st.sent, st.last_task_id, st.last_sent_occurrence) == (3, newer.task_id, newer.at)

    assert b.claim([newest]) == [newest] and b.mark_sent([newest]) == 1
    st = states(a)["job"]
    assert (st.sent, st.last_task_id, st.last_sent_occurrence) == (4, newest.task_id, newest.at)
    assert st.last_sent_at >= at_newer.last_sent_at


# --------------------------------------------------------------------------- 7. migration from version 1


V1_CLAIMED_AT = datetime(2024, 1, 1, tzinfo=UTC)


def _build_version_1(raw) -> None:
    """The version-1 schema: no nodes table, no last_sent_occurrence, no cluster id; with history."""
    with raw.begin() as conn:
        metadata.create_all(conn)
    with raw.begin() as conn:
        conn.exec_driver_sql(f"DROP TABLE {nodes_table.name}")
    with raw.begin() as conn:
        conn.exec_driver_sql(f"ALTER TABLE {schedules_table.name} DROP COLUMN last_sent_occurrence")
    v1_schedules = sa.Table(
        schedules_table.name, sa.MetaData(),
        *[c._copy() for c in schedules_table.columns if c.name != "last_sent_occurrence"])
    with raw.begin() as conn:
        conn.execute(meta_table.insert(), [{"key": "schema_version", "value": "1"}])
        conn.execute(leader_table.insert(), [{"id": 1, "term": 4, "node": "old-node", "updated_at": T0}])
        conn.execute(claims_table.insert(), [
            {"schedule": "a", "scheduled_at": o.at, "claimed_at": V1_CLAIMED_AT, "node": "old-node", "term": 4,
             "task_id": o.task_id, "status": status, "reason": None, "attempts": 1 if status == "sent" else 0,
             "sent_at": o.at if status == "sent" else None, "op_token": None}
            for o, status in ((occ("a", 0), "sent"), (occ("a", 1), "sent"), (occ("a", 2), "claimed"))
        ])
        conn.execute(v1_schedules.insert(), [
            {"name": "a", "last_occurrence": occ("a", 2).at, "last_task_id": occ("a", 1).task_id,
             "last_sent_at": occ("a", 1).at, "last_error": None, "last_error_at": None, "sent": 2, "skipped": 0,
             "missed": 0, "failed": 0, "claim_lost": 5, "resent": 0, "updated_at": T0},
        ])


def _schema(raw):
    with raw.connect() as conn:
        insp = sa.inspect(conn)
        tables = set(insp.get_table_names())
        columns = {c["name"] for c in insp.get_columns(schedules_table.name)}
        meta = dict(conn.execute(sa.select(meta_table.c.key, meta_table.c.value)).all())
    return tables, columns, meta


def test_a_version_1_database_is_migrated_to_version_2_and_keeps_its_rows(db_url, raw, make_store):
    """A claim database written by release 1 (no ``cluster_beat_nodes`` table, no
    ``last_sent_occurrence`` column, no cluster id, schema_version '1') opens:
    it is migrated to the current version (column and table exist, version '2', a cluster
    id is recorded and stays the same on the next open), keeps every claim row,
    counter and the recorded term, and works: heartbeats, claims, and a send
    records last_sent_occurrence. Two nodes opening it at once both succeed.

    Fails if the migration step is missing (the new column is selected by every
    schedule_states() and written by every mark_sent), if it is not applied in
    order, or if opening rewrote history.
    """
    _build_version_1(raw)
    tables, columns, meta = _schema(raw)
    assert nodes_table.name not in tables and "last_sent_occurrence" not in columns
    assert meta == {"schema_version": "1"}

    opened: List[ClaimStore] = []
    errors: List[BaseException] = []
    barrier = threading.Barrier(2)

    def open_one(node: str) -> None:
        try:
            store = ClaimStore(db_url, node_id=node)
            barrier.wait(timeout=30)
            store.open()
            opened.append(store)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=open_one, args=(n,)) for n in ("node-new", "node-other")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=90)
    try:
        assert not errors, errors
        assert len(opened) == 2
        store = next(s for s in opened if s.node_id == "node-new")

        tables, columns, meta = _schema(raw)
        assert nodes_table.name in tables and "last_sent_occurrence" in columns
        assert meta["schema_version"] == str(SCHEMA_VERSION) == "6"
        assert meta.get("cluster_id") and store.cluster_id == meta["cluster_id"] == opened[1].cluster_id

        rows = [(r.schedule, r.scheduled_at, r.node, r.status, r.term) for r in store.claims()]
        assert rows == [("a", occ("a", 0).at, "old-node", "sent", 4), ("a", occ("a", 1).at, "old-node", "sent", 4),
                        ("a", occ("a", 2).at, "old-node", "claimed", 4)]
        st = states(store)["a"]
        assert (st.sent, st.claim_lost, st.last_task_id, st.last_occurrence, st.last_sent_occurrence) == (
            2, 5, occ("a", 1).task_id, occ("a", 2).at, None)
        assert store.current_term() == 4

        store.heartbeat(scheduling=True, register=True)
        assert [n.node for n in store.nodes()] == ["node-new"]
        assert store.claim([occ("a", 3)], term=5) == [occ("a", 3)]
        assert store.mark_sent([occ("a", 3)]) == 1
        st = states(store)["a"]
        assert (st.sent, st.last_task_id, st.last_sent_occurrence) == (3, occ("a", 3).task_id, occ("a", 3).at)
        # old-node never heartbeated to this store: its unsent claim is taken over
        assert store.take_over_stale(0.0, term=5) == [occ("a", 2)]
    finally:
        for s in opened:
            s.close()

    again = make_store("node-again")
    assert again.cluster_id == meta["cluster_id"]
    assert _schema(raw)[2]["schema_version"] == str(SCHEMA_VERSION)


@pytest.mark.parametrize("db_url", ["mysql"], indirect=True)
def test_a_migration_interrupted_after_its_ddl_is_completed_on_the_next_open(db_url, raw, make_store):
    """MariaDB commits each ALTER TABLE on its own: a node killed after the
    migration's ALTER and before the version update leaves version '1' with the
    new column present. The next open must complete the migration (the step
    finds the column there) instead of failing for ever.

    Built by hand: the version-1 database, then the migration's own DDL.
    """
    _build_version_1(raw)
    with raw.begin() as conn:
        conn.exec_driver_sql(f"ALTER TABLE {schedules_table.name} ADD COLUMN last_sent_occurrence DATETIME(6) NULL")
    store = make_store("node-new")
    assert _schema(raw)[2]["schema_version"] == str(SCHEMA_VERSION)
    assert states(store)["a"].sent == 2


# --------------------------------------------------------------------------- 8. pruning keeps up

PRUNE_SCHEDULES = 1000
PRUNE_SECONDS = 40  # every schedule fired every second for 40 s: 40,000 rows, several passes
PRUNE_BUDGET = 2.0
PASS_MARGIN = 4.0  # one batch may run past the budget; generous for a loaded host
MIN_RATE = 1000.0  # rows/s: what 1,000 every-second schedules produce
OLD = datetime(2020, 1, 1, tzinfo=UTC)


def _bulk_history(raw) -> None:
    """120,000 old finished rows, plus old unsent claims and recent sent rows that must stay."""

    def row(name: str, at: datetime, status: str, n: int) -> dict:
        return {"schedule": name, "scheduled_at": at, "claimed_at": at, "node": "old-node", "term": None,
                "task_id": str(uuid.UUID(int=n)), "status": status, "reason": None, "attempts": 1,
                "sent_at": at if status != "claimed" else None, "op_token": None}

    names = [f"job-{i:04d}" for i in range(PRUNE_SCHEDULES)]
    batch: List[dict] = []
    n = 0
    with raw.begin() as conn:
        for k in range(PRUNE_SECONDS):
            at = OLD + timedelta(seconds=k)
            for name in names:
                n += 1
                batch.append(row(name, at, "sent", n))
            if len(batch) >= 20000:
                conn.execute(claims_table.insert(), batch)
                batch = []
        # kept: old but still claimed (awaiting a resend), and finished but recent
        batch += [row(f"job-{i:04d}", OLD - timedelta(seconds=1), "claimed", n + 1 + i) for i in range(100)]
        batch += [row(f"job-{i:04d}", T0, "sent", n + 1001 + i) for i in range(100)]
        conn.execute(claims_table.insert(), batch)


@pytest.mark.timeout(600)
def test_pruning_in_time_boxed_passes_keeps_up_with_a_thousand_every_second_schedules(db_url, raw, make_store):
    """40,000 finished rows (1,000 schedules x 40 s, ``sent``, old) are pruned
    by repeated ``prune_pass(cutoff, time_budget=2.0)`` calls: each pass returns
    within the budget plus a margin (one batch), the passes together delete
    every old finished row and nothing else (old ``claimed`` rows and recent rows
    stay), and the overall rate is at least 1,000 rows/s, the rate 1,000
    every-second schedules produce, on PostgreSQL and MariaDB (SQLite too: the
    rates are printed).

    Fails if a pass ignored its budget, if a batch deleted by a slow plan (the
    rate), or if pruning touched unsent claims.
    """
    created = time.monotonic()
    make_store("node-a").close()  # the tables, as the store creates them
    _bulk_history(raw)
    insert_s = time.monotonic() - created
    store = make_store("node-a")
    cutoff = OLD + timedelta(days=1)
    total = PRUNE_SCHEDULES * PRUNE_SECONDS

    passes = []
    deleted = 0
    started = time.monotonic()
    done = False
    while not done:
        t = time.monotonic()
        n, done = store.prune_pass(cutoff, time_budget=PRUNE_BUDGET)
        passes.append((n, time.monotonic() - t))
        deleted += n
        assert len(passes) <= total // 1000 + 5, "prune_pass never reports done"
    elapsed = time.monotonic() - started
    rate = deleted / elapsed
    print(f"\nprune {dialect_of(db_url)}: {deleted} rows in {elapsed:.1f}s = {rate:,.0f} rows/s over "
          f"{len(passes)} passes (longest {max(p[1] for p in passes):.2f}s); insert took {insert_s:.1f}s")

    assert deleted == total
    assert max(p[1] for p in passes) <= PRUNE_BUDGET + PASS_MARGIN, passes
    remaining = store.claims()
    assert len(remaining) == 200
    assert sorted({r.status for r in remaining}) == ["claimed", "sent"]
    assert all(r.scheduled_at >= cutoff for r in remaining if r.status == "sent")
    assert rate >= MIN_RATE, f"{dialect_of(db_url)} pruned {rate:.0f} rows/s, below {MIN_RATE:.0f}"
