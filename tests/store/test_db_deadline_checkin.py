"""The ``cluster_beat_db_timeout`` watchdog lets go of a connection before the pool takes it back.

Once a connection is back in the pool another thread may check it out; a deadline of
the call that returned it must then never cut it (that would fail the other thread's
call as a spurious ``StoreUnavailable``). The test holds a real PostgreSQL connection
inside the pool's check-in (after the connection's reset, before the pool can hand it
out again) until well past the call's deadline, and asserts the connection was left
alone: it still answers, no "no answer within" WARNING, and the store goes on using it.
"""
from __future__ import annotations

import logging
import re
import time

import pytest
import sqlalchemy as sa

from celery_cluster_beat.store import ClaimStore

BOUND = 1.0
#: The store's bound while it prepares the schema and sets up its connection: set-up, not the
#: call under test (preparing the schema on a loaded machine can take longer than BOUND).
SETUP_BOUND = 30.0
#: Past the deadline by this much: the watchdog (waking every 50 ms at most) has had ample time.
PAST = 2.0
WARNING_LINE = re.compile(r"no answer within [0-9.]+s \(cluster_beat_db_timeout\)")


@pytest.mark.timeout(60)
def test_a_deadline_passing_while_the_connection_is_checked_in_does_not_cut_it(pg_url, caplog):
    caplog.set_level(logging.WARNING, logger="celery_cluster_beat.store.claims")
    store = ClaimStore(pg_url, node_id="node-a", db_timeout=SETUP_BOUND)
    store.open()
    try:
        backend = lambda: store._run(lambda conn: conn.exec_driver_sql("SELECT pg_backend_pid()").scalar(),
                                     write=False)
        first = backend()  # the pool's one connection, set up
        # Each call's deadline is armed from db_timeout when the call starts: the call under test
        # (and the one after it) run under the 1 s bound, its deadline passing inside the check-in.
        store.db_timeout = BOUND
        seen: list[object] = []
        armed = {"on": True}

        def slow_checkin(dbapi_conn, record) -> None:  # registered after the store's own: runs after it
            if not armed["on"] or dbapi_conn is None:
                return
            armed["on"] = False
            time.sleep(BOUND + PAST)  # the call's deadline passes while the pool takes the connection
            try:
                cur = dbapi_conn.cursor()
                cur.execute("SELECT 1")
                seen.append(cur.fetchone()[0])
                cur.close()
                dbapi_conn.rollback()
            except Exception as exc:  # cut: what the next user of the connection would meet
                seen.append(exc)

        engine = store._engine
        sa.event.listen(engine, "checkin", slow_checkin)
        caplog.clear()
        started = time.monotonic()
        store.db_now()  # returns only after the check-in above
        assert time.monotonic() - started >= BOUND + PAST
        assert seen == [1], seen
        assert not [r for r in caplog.records if WARNING_LINE.search(r.getMessage())]
        assert backend() == first  # the same connection serves the next call: never cut nor replaced
        assert not [r for r in caplog.records if WARNING_LINE.search(r.getMessage())]
    finally:
        store.close()
