"""The SQL claim store: every occurrence is claimed by exactly one node.

Each test runs against a SQLite file, a real PostgreSQL and a real MariaDB
(the ``db_url`` fixture gives each test an empty database of its own), so
what is specified here holds for all three dialects.
"""
from __future__ import annotations

import multiprocessing
import random
import sqlite3
import threading
import time
from datetime import datetime, timedelta, timezone
from typing import Dict, List

import pytest
import sqlalchemy as sa

from celery_cluster_beat.errors import ConfigError
from celery_cluster_beat.schedules.occurrence import Occurrence, occurrence_task_id
from celery_cluster_beat.store import (
    SCHEMA_VERSION,
    ClaimStore,
    SchemaVersionError,
    StaleTermError,
    StoreUnavailable,
)
from celery_cluster_beat.store.schema import leader_table, meta_table

UTC = timezone.utc
T0 = datetime(2021, 1, 1, tzinfo=UTC)  # in the past: a stale claim is taken over only after its instant


def occ(name: str, minute: int, micro: int = 0) -> Occurrence:
    return Occurrence(name, T0 + timedelta(minutes=minute, microseconds=micro))


def minute(at: datetime) -> int:
    """Minutes since T0, the inverse of occ()."""
    return int((at - T0).total_seconds() // 60)


def keys(occurrences) -> List[tuple]:
    return [(o.schedule, o.at) for o in occurrences]


def states(store: ClaimStore) -> Dict[str, object]:
    return {s.name: s for s in store.schedule_states()}


# --------------------------------------------------------------------------- life cycle


def test_constructing_does_not_connect_and_the_logged_url_hides_the_password():
    # Nothing listens on port 1: any connection attempt would fail.
    store = ClaimStore("postgresql+psycopg://u:secret@127.0.0.1:1/x", node_id="n1")
    assert "secret" not in store.url_masked and "***" in store.url_masked
    assert "secret" not in repr(store)
    store.close()  # before open: nothing to release, no error
    with pytest.raises(RuntimeError, match="not open"):
        store.current_term()
    with pytest.raises(StoreUnavailable):  # open() is where connecting happens
        store.open()
    store.close()


@pytest.mark.parametrize(
    "url, message",
    [("not a url", "not a valid SQLAlchemy URL"), ("oracle://u:p@h/db", "supported: sqlite, postgresql")],
)
def test_a_bad_url_is_a_config_error_that_does_not_echo_it(url, message):
    with pytest.raises(ConfigError, match=message) as info:
        ClaimStore(url, node_id="n1")
    assert "u:p" not in str(info.value)


def test_open_creates_the_tables_and_records_the_schema_version(make_store, raw, db_url):
    store = make_store()
    store.open()  # idempotent
    with raw.connect() as conn:
        assert set(sa.inspect(conn).get_table_names()) >= {
            "cluster_beat_claims", "cluster_beat_schedules", "cluster_beat_leader", "cluster_beat_meta"
        }
        version = conn.execute(sa.select(meta_table.c.value).where(meta_table.c.key == "schema_version")).scalar()
    assert version == str(SCHEMA_VERSION) == "6"
    assert store.current_term() == 0
    other = make_store("node-b")  # a second node opens the existing tables
    assert other.claim([occ("a", 0)]) == [occ("a", 0)]
    store.close()
    store.close()  # twice is fine
    if db_url.startswith("sqlite"):
        with sqlite3.connect(db_url.split("///", 1)[1]) as db:
            assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"


def test_a_database_stamped_by_a_newer_release_is_refused(make_store, raw, db_url):
    make_store().close()
    with raw.begin() as conn:
        conn.execute(sa.update(meta_table).where(meta_table.c.key == "schema_version").values(value="99"))
    store = ClaimStore(db_url, node_id="node-b")
    with pytest.raises(SchemaVersionError, match=r"schema version 99, newer than version 6") as info:
        store.open()
    assert isinstance(info.value, ConfigError)  # start-up configuration problem
    assert "Upgrade celery-cluster-beat" in str(info.value)
    with pytest.raises(RuntimeError, match="not open"):
        store.claim([occ("a", 0)])
    store.close()


# --------------------------------------------------------------------------- claiming


def test_claim_returns_only_the_occurrences_this_call_inserted(make_store):
    store = make_store()
    first = [occ("a", 1), occ("b", 1, micro=7)]
    assert store.claim(first, term=1) == first
    # Input order is kept; what was already claimed is left out, even mixed
    # inside one batch.
    batch = [occ("c", 1), occ("b", 1, micro=7), occ("a", 2), occ("a", 1), occ("c", 1)]
    assert store.claim(batch, term=1) == [occ("c", 1), occ("a", 2)]
    assert store.claim(batch, term=1) == []
    assert store.claim([]) == []

    rows = store.claims()
    assert [(r.schedule, r.scheduled_at) for r in rows] == [
        ("a", T0 + timedelta(minutes=1)), ("c", T0 + timedelta(minutes=1)),
        ("b", T0 + timedelta(minutes=1, microseconds=7)), ("a", T0 + timedelta(minutes=2)),
    ]  # by instant (to the microsecond), then name
    for row in rows:
        assert (row.status, row.node, row.term, row.attempts, row.sent_at) == ("claimed", "node-a", 1, 0, None)
        assert row.task_id == occurrence_task_id(row.schedule, row.scheduled_at) == row.occurrence.task_id
        assert row.scheduled_at.tzinfo is UTC and row.claimed_at.tzinfo is UTC
    lost = {name: s.claim_lost for name, s in states(store).items()}
    assert lost == {"a": 1 + 2, "b": 1 + 1, "c": 0 + 1}


def test_claims_lost_to_another_node_are_counted(make_store):
    a, b = make_store("node-a"), make_store("node-b")
    burst = [occ(f"s{i}", 0) for i in range(5)]
    assert a.claim(burst[:3]) == burst[:3]
    assert b.claim(burst) == burst[3:]
    assert {r.schedule: r.node for r in a.claims()} == {
        "s0": "node-a", "s1": "node-a", "s2": "node-a", "s3": "node-b", "s4": "node-b"
    }
    assert sum(s.claim_lost for s in a.schedule_states()) == 3


def test_aware_instants_in_any_zone_are_the_same_occurrence(make_store):
    store = make_store()
    paris = timezone(timedelta(hours=1))
    assert store.claim([Occurrence("a", datetime(2021, 1, 1, 1, 0, tzinfo=paris))]) != []
    assert store.claim([Occurrence("a", T0)]) == []
    assert store.claims()[0].scheduled_at == T0


def test_names_are_compared_byte_for_byte(make_store):
    # MySQL's default collations would fold case (and trailing spaces):
    # "Report" must not take "report"'s claim.
    store = make_store()
    names = [occ("report", 0), occ("Report", 0), occ("report ", 0), occ("rapport", 0), occ("répört", 0)]
    assert store.claim(names) == names
    assert sorted(r.schedule for r in store.claims()) == sorted(o.schedule for o in names)


def test_a_name_too_long_for_the_column_is_refused_not_truncated(make_store):
    store = make_store()
    with pytest.raises(ValueError, match="1 to 255 characters"):
        store.claim([occ("x" * 256, 0)])
    assert store.claims() == []


# --------------------------------------------------------------------------- concurrency


def _claim_worker(url, node, specs, chunk, seed, barrier, results):
    """One replica: open the store, wait for the others, claim everything in its own order."""
    store = ClaimStore(url, node_id=node)
    try:
        store.open()  # all replicas create the tables at once, too
        occurrences = [Occurrence(name, datetime.fromisoformat(at)) for name, at in specs]
        rnd = random.Random(seed)
        rnd.shuffle(occurrences)
        barrier.wait(timeout=60)
        won = []
        for start in range(0, len(occurrences), chunk):
            won.extend(store.claim(occurrences[start:start + chunk]))
            time.sleep(rnd.uniform(0, 0.004))  # let the others interleave (SQLite claims are quick)
        results.put((node, [(o.schedule, o.at.isoformat()) for o in won], None))
    except BaseException as exc:  # report it, the parent fails the test
        results.put((node, [], f"{type(exc).__name__}: {exc}"))
    finally:
        store.close()


def test_replicas_claiming_the_same_occurrences_at_once_win_each_exactly_once(db_url, raw):
    """Four processes start claiming the same 500 occurrences at the same moment."""
    ctx = multiprocessing.get_context("spawn")
    specs = [(f"job-{i % 50:02d}", (T0 + timedelta(minutes=i // 50)).isoformat()) for i in range(500)]
    nodes = [f"replica-{i}" for i in range(4)]
    barrier = ctx.Barrier(len(nodes))
    results = ctx.Queue()
    # Different batch sizes and orders per replica, so batches overlap partly
    # and a batch is often won in part.
    procs = [
        ctx.Process(target=_claim_worker, args=(db_url, node, specs, 37 + 23 * i, i, barrier, results))
        for i, node in enumerate(nodes)
    ]
    for p in procs:
        p.start()
    try:
        outcome = {}
        for _ in nodes:
            node, won, error = results.get(timeout=90)
            assert error is None, f"{node}: {error}"
            outcome[node] = {(name, datetime.fromisoformat(at)) for name, at in won}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()

    everything = {(name, datetime.fromisoformat(at)) for name, at in specs}
    assert set().union(*outcome.values()) == everything
    assert sum(len(won) for won in outcome.values()) == len(everything)  # pairwise disjoint
    # ... and the table agrees with what each replica was told.
    store = ClaimStore(db_url, node_id="observer")
    with store:
        owner = {(r.schedule, r.scheduled_at): r.node for r in store.claims()}
        assert owner == {k: node for node, won in outcome.items() for k in won}
        assert sum(s.claim_lost for s in store.schedule_states()) == 3 * 500


# --------------------------------------------------------------------------- fencing


def test_a_stale_term_is_refused_and_writes_nothing(make_store):
    old_leader, new_leader = make_store("node-old"), make_store("node-new")
    assert new_leader.claim([occ("a", 1)], term=5) == [occ("a", 1)]
    assert new_leader.current_term() == 5

    with pytest.raises(StaleTermError) as info:
        old_leader.claim([occ("a", 2), occ("b", 2)], term=4)
    assert info.value.seen_term == 5 and info.value.term == 4
    assert "term 5" in str(info.value)
    with pytest.raises(StaleTermError):
        old_leader.record([occ("a", 3)], status="skipped", reason="overlap", term=4)
    with pytest.raises(StaleTermError):
        old_leader.take_over_stale(datetime.now(UTC) + timedelta(seconds=1), term=4)
    assert keys(r.occurrence for r in new_leader.claims()) == [("a", T0 + timedelta(minutes=1))]
    assert "b" not in states(new_leader)  # no counters written either

    assert new_leader.claim([occ("a", 2)], term=5) == [occ("a", 2)]  # the same term again
    assert old_leader.claim([occ("a", 3)], term=6) == [occ("a", 3)]  # a newer term takes over
    assert new_leader.current_term() == old_leader.current_term() == 6
    with pytest.raises(StaleTermError):
        new_leader.claim([occ("a", 4)], term=5)
    assert [r.term for r in new_leader.claims()] == [5, 5, 6]


def test_claiming_without_a_term_leaves_the_leader_row_alone(make_store, raw):
    store = make_store()
    store.claim([occ("a", 1)], term=3)
    with raw.connect() as conn:
        before = conn.execute(sa.select(leader_table)).one()
    assert store.claim([occ("a", 2)]) == [occ("a", 2)]
    store.record([occ("a", 3)], status="missed", reason="catchup")
    store.take_over_stale(3600)
    with raw.connect() as conn:
        assert conn.execute(sa.select(leader_table)).one() == before
    assert (before.term, before.node) == (3, "node-a")
    assert store.claims()[-1].term is None


# --------------------------------------------------------------------------- final states


def test_skipped_and_missed_occurrences_take_the_claim(make_store):
    store, other = make_store("node-a"), make_store("node-b")
    overlap = [occ("report", 1), occ("report", 2)]
    assert store.record(overlap, status="skipped", reason="overlap") == overlap
    assert other.claim(overlap) == []  # nobody sends what was skipped
    assert store.record([occ("report", 0), occ("report", 2)], status="missed", reason="catchup") == [occ("report", 0)]

    rows = {minute(r.scheduled_at): (r.status, r.reason, r.node) for r in store.claims()}
    assert rows == {
        0: ("missed", "catchup", "node-a"),
        1: ("skipped", "overlap", "node-a"),
        2: ("skipped", "overlap", "node-a"),
    }
    st = states(store)["report"]
    assert (st.skipped, st.missed, st.sent, st.claim_lost) == (2, 1, 0, 2 + 1)
    assert st.last_occurrence == T0 + timedelta(minutes=2)
    with pytest.raises(ValueError, match="'skipped' or 'missed'"):
        store.record(overlap, status="sent", reason="x")


def test_mark_sent_and_mark_failed_record_the_outcome_of_a_publish(make_store):
    store, other = make_store("node-a"), make_store("node-b")
    a, b, c = occ("a", 1), occ("a", 2), occ("b", 1)
    assert store.claim([a, b, c]) == [a, b, c]

    assert store.mark_failed(a, "ConnectionError: broker down") is True  # will be retried
    row = store.claims("a")[0]
    assert (row.status, row.reason, row.attempts, row.sent_at) == ("claimed", "ConnectionError: broker down", 1, None)
    assert states(store)["a"].last_error == "ConnectionError: broker down"
    assert states(store)["a"].last_error_at is not None and states(store)["a"].failed == 0

    assert other.mark_sent([a, b]) == 0  # not its rows
    before = datetime.now(UTC)
    assert store.mark_sent([b, occ("a", 99)]) == 1  # only what it holds claimed
    assert store.mark_sent([a, b]) == 1  # b is already sent
    assert store.mark_sent([a]) == 0
    ra, rb = store.claims("a")
    assert (ra.status, ra.attempts, rb.status, rb.attempts) == ("sent", 2, "sent", 1)
    assert rb.sent_at <= ra.sent_at and rb.sent_at >= before - timedelta(seconds=1)
    st = states(store)["a"]
    # The last run only moves forward: a (late) send of an older occurrence does not replace it.
    assert (st.sent, st.last_task_id, st.last_sent_at, st.last_sent_occurrence) == (2, b.task_id, rb.sent_at, b.at)
    assert store.mark_sent([a, b, occ("a", 3)]) == 0

    assert store.mark_failed(c, "x" * 5000, final=True) is True
    rc = store.claims("b")[0]
    assert rc.status == "failed" and rc.attempts == 1 and len(rc.reason) <= 2000
    assert states(store)["b"].failed == 1
    assert store.mark_sent([c]) == 0 and store.mark_failed(c, "again") is False
    assert store.mark_failed(occ("zzz", 0), "never claimed") is False


def test_many_occurrences_that_cannot_be_sent_are_failed_at_once_each_with_its_own_reason(make_store):
    """fail_claimed: the rows this node holds end ``failed`` with their own reasons, in one
    transaction however many; another node's rows, sent rows and unclaimed ones are left alone."""
    store, other = make_store("node-a"), make_store("node-b")
    mine = [occ(f"refused-{i:03d}", 1) for i in range(300)]
    theirs, sent = occ("taken", 1), occ("sent", 1)
    assert store.claim(mine + [sent]) == mine + [sent] and other.claim([theirs]) == [theirs]
    assert store.mark_sent([sent]) == 1
    failed = [(o, f"stored schedule {o.schedule!r}: options.headers.task: reserved") for o in mine]
    failed += [(theirs, "not mine"), (sent, "already sent"), (occ("never", 1), "never claimed")]
    assert store.fail_claimed(failed) == sorted(mine, key=lambda o: (o.schedule, o.at))
    rows = {r.schedule: r for r in store.claims()}
    assert all((rows[o.schedule].status, rows[o.schedule].reason, rows[o.schedule].attempts)
               == ("failed", f"stored schedule {o.schedule!r}: options.headers.task: reserved", 1) for o in mine)
    assert (rows["taken"].status, rows["taken"].node, rows["sent"].status) == ("claimed", "node-b", "sent")
    assert "never" not in rows
    st = states(store)
    assert st["refused-007"].failed == 1 and st["refused-007"].last_error.startswith("stored schedule 'refused-007'")
    assert store.fail_claimed(failed) == [] and states(store)["refused-007"].failed == 1  # once only


def test_a_burst_of_5000_is_claimed_and_marked_sent_in_a_few_statements(make_store):
    store = make_store()
    burst = [occ(f"s{i % 250:03d}", i // 250) for i in range(5000)]
    started = time.monotonic()
    won = store.claim(burst)
    assert store.mark_sent(won) == 5000
    elapsed = time.monotonic() - started
    assert won == burst
    assert {r.status for r in store.claims()} == {"sent"}
    assert sum(s.sent for s in store.schedule_states()) == 5000
    assert elapsed < 10, f"claim + mark_sent of 5000 took {elapsed:.1f}s"  # ~0.3 s normally


def test_last_occurrence_only_moves_forward(make_store):
    store = make_store()
    store.claim([occ("a", 10), occ("a", 5), occ("b", 1)])
    store.claim([occ("a", 3)])  # an older one claimed later
    assert store.last_occurrences() == {"a": T0 + timedelta(minutes=10), "b": T0 + timedelta(minutes=1)}
    store.record([occ("a", 11)], status="missed", reason="catchup")
    assert store.last_occurrences()["a"] == T0 + timedelta(minutes=11)
    assert [minute(r.scheduled_at) for r in store.claims("a", since=T0 + timedelta(minutes=5))] == [5, 10, 11]


# --------------------------------------------------------------------------- stale claims


def test_a_dead_nodes_claims_are_taken_over_exactly_once(make_store):
    dead = make_store("node-dead")
    sweepers = [make_store("node-a"), make_store("node-b")]  # (opened first: the sweep follows the fresh claim at once)
    stale = [occ(f"s{i}", i % 3) for i in range(20)]
    dead.claim(stale)
    sent = occ("done", 0)
    dead.claim([sent])
    dead.mark_sent([sent])
    time.sleep(3.0)
    grace = 2.0  # the stale rows are 3 s old (or more), the fresh one is not yet 2 s old when swept
    fresh = occ("fresh", 0)
    dead.claim([fresh])  # claimed within the grace: its node may still send it

    barrier = threading.Barrier(len(sweepers))
    taken: Dict[str, List[Occurrence]] = {}
    errors: List[BaseException] = []

    def sweep(store: ClaimStore) -> None:
        try:
            barrier.wait(timeout=30)
            taken[store.node_id] = store.take_over_stale(grace, limit=500)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=sweep, args=(s,)) for s in sweepers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors

    all_taken = taken["node-a"] + taken["node-b"]
    assert sorted(keys(all_taken)) == sorted(keys(stale))  # every stale row once, by one sweeper
    for o in all_taken:
        assert o.task_id == occurrence_task_id(o.schedule, o.at)  # resent under the same id
    rows = {(r.schedule, r.scheduled_at): r for r in dead.claims()}
    for node, occurrences in taken.items():
        for o in occurrences:
            row = rows[(o.schedule, o.at)]
            assert (row.node, row.status) == (node, "claimed") and row.claimed_at > rows[("fresh", fresh.at)].claimed_at
    assert rows[("fresh", fresh.at)].node == "node-dead"
    assert rows[("done", sent.at)].status == "sent"
    assert sum(s.resent for s in dead.schedule_states()) == 20

    assert dead.mark_sent(stale) == 0  # the old owner, back from the dead, owns nothing
    winner = sweepers[0] if taken["node-a"] else sweepers[1]
    assert winner.mark_sent(taken[winner.node_id]) == len(taken[winner.node_id])
    # Nothing else is left stale (the fresh claim may be by now, on a loaded host: its node is dead).
    assert [o for o in sweepers[0].take_over_stale(grace) if o.schedule != "fresh"] == []


def test_take_over_is_bounded_by_limit(make_store):
    dead, sweeper = make_store("node-dead"), make_store("node-a")
    dead.claim([occ("s", i) for i in range(7)])
    time.sleep(2.5)  # a grace of 2 s: the adopted rows stay fresh across the next calls, even loaded
    first = sweeper.take_over_stale(2.0, limit=5)
    assert first == [occ("s", i) for i in range(5)]  # oldest claims first (then by key)
    assert len(sweeper.take_over_stale(2.0, limit=5)) == 2  # adopted rows are no longer stale
    assert sweeper.take_over_stale(2.0, limit=5) == []


# --------------------------------------------------------------------------- pruning


def test_prune_deletes_old_finished_rows_in_batches_and_keeps_the_rest(make_store):
    store = make_store()
    old = [occ("a", i) for i in range(6)]  # minutes 0..5
    new = [occ("a", 60 + i) for i in range(3)]
    store.claim(old[:4] + new)
    store.mark_sent(old[:3] + new)
    store.record(old[4:5], status="skipped", reason="overlap")
    store.claim(old[5:])
    store.mark_failed(old[5], "boom", final=True)
    # old[3] stays 'claimed': not sent yet, so kept whatever its age
    before = states(store)["a"]
    cutoff = T0 + timedelta(minutes=30)

    assert store.prune(cutoff, batch=2, max_batches=1) == 2
    assert store.prune(cutoff, batch=2) == 3  # the other 3 old finished rows, in two more batches
    assert store.prune(cutoff, batch=2) == 0
    remaining = [(minute(r.scheduled_at), r.status) for r in store.claims()]
    assert remaining == [(3, "claimed"), (60, "sent"), (61, "sent"), (62, "sent")]
    after = states(store)["a"]
    assert (after.sent, after.skipped, after.failed, after.last_occurrence, after.last_task_id) == (
        before.sent, before.skipped, before.failed, before.last_occurrence, before.last_task_id
    )
    # A pruned occurrence is not claimable again through catch-up: the caller
    # resumes after last_occurrence, which survives.
    assert store.last_occurrences()["a"] == T0 + timedelta(minutes=62)


# --------------------------------------------------------------------------- inputs


def test_naive_datetimes_are_refused(tmp_path):
    with ClaimStore(f"sqlite:///{tmp_path}/c.sqlite3", node_id="n") as store:
        naive = datetime(2030, 1, 1)
        for call in (
            lambda: store.prune(naive),
            lambda: store.claims(since=naive),
        ):
            with pytest.raises(ValueError, match="naive"):
                call()


def test_an_old_sqlite_without_returning_and_with_999_parameters_gives_the_same_answers(tmp_path):
    # SQLite before 3.35 (e.g. Debian 11's) has no RETURNING, and before 3.32
    # allows 999 bind parameters: the store then finds its rows by op_token
    # and uses small batches. Forced here, whatever this SQLite is.
    url = f"sqlite:///{tmp_path}/c.sqlite3"
    with ClaimStore(url, node_id="node-a") as store, ClaimStore(url, node_id="node-b") as other:
        for s in (store, other):
            s._dialect.returning, s._dialect.batch = False, 7
        burst = [occ(f"s{i % 5}", i // 5) for i in range(40)]
        assert other.claim(burst[10:20]) == burst[10:20]
        assert store.claim(burst) == burst[:10] + burst[20:]
        assert store.mark_sent(burst) == 30
        assert other.mark_failed(burst[10], "boom") is True
        assert sorted(keys(store.take_over_stale(0))) == sorted(keys(burst[10:20]))
        assert store.mark_sent(burst[10:20]) == 10
        assert store.prune(T0 + timedelta(minutes=5)) == 25
        assert sum(s.sent for s in store.schedule_states()) == 40
