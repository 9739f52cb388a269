"""Property: whatever text a row written past the API holds, the command line prints each stored
schedule as exactly one line with nothing a terminal would act on (issue 20's hostile-input suite,
the command-line part).

Hypothesis draws names, descriptions, owners and failure reasons from every Unicode category
(control and format characters, separators, bidi overrides, surrogates excluded: the claim
database cannot store them, see ``config.values``), writes them straight into a SQLite claim
database, and runs ``list`` and ``history`` through the real command (in-process, click's runner).
"""
from __future__ import annotations

import uuid
from datetime import timedelta

import sqlalchemy as sa
from celery import Celery
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_cluster_beat.store.schema import claims_table, stored_schedules_table
from test_cli_escaping import invoke, prepared, unprintable

#: Text a row can hold: any character but NUL and lone surrogates, up to the name column's length.
TEXT = st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), min_size=1, max_size=60)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(names=st.lists(TEXT, min_size=1, max_size=4, unique_by=str.casefold), description=TEXT, owner=TEXT,
       reason=TEXT)
def test_any_stored_text_is_one_line_per_schedule_with_nothing_a_terminal_acts_on(
        tmp_path_factory, names, description, owner, reason):
    db_url = f"sqlite:///{tmp_path_factory.mktemp('prop')}/claims.sqlite3"
    now = prepared(db_url)
    engine = sa.create_engine(db_url)
    with engine.begin() as conn:
        for name in names:
            conn.execute(sa.insert(stored_schedules_table).values(
                name=name, task="t.record", schedule="every 60s", zone=None, args="[]", kwargs="{}",
                options="{}", description=description, owner=owner, enabled=True, deleted=False, version=1,
                created_at=now, changed_at=now, next_at=None))
            conn.execute(sa.insert(claims_table).values(
                schedule=name, scheduled_at=now - timedelta(minutes=1), claimed_at=now, node="beat-1",
                task_id=str(uuid.uuid4()), status="failed", reason=reason, attempts=1))
    engine.dispose()
    app = Celery("prop_" + uuid.uuid4().hex[:8], broker="memory://", set_as_current=False)
    app.conf.update(cluster_beat_db_url=db_url, cluster_beat_redis_url="", beat_schedule={})
    listed = invoke(app, "list")
    assert listed.exit_code == 0, listed.output
    assert unprintable(listed.stdout) == [], listed.stdout
    assert len(listed.stdout.strip().splitlines()) == len(names) + 1 + 2, listed.stdout  # header, rows, note
    for name in names:
        shown = invoke(app, "history", "--", name)  # "--": a name may start with "-", as on any command line
        assert shown.exit_code == 0, shown.output
        assert unprintable(shown.stdout + shown.stderr) == [], shown.stdout
        assert len(shown.stdout.strip().splitlines()) == 2, shown.stdout  # header and the one failed row
