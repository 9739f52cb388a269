"""What the command line prints of stored text cannot drive the operator's terminal (issue 20, item 7).

Rows written past the API (here: straight SQL inserts, as an older release, a hand-written
migration or anyone with the database's password could) hold names, descriptions, owners,
node names and reasons with escape sequences (``ESC[2J`` clears the screen, ``ESC]0;...BEL``
retitles the window), newlines (a fake row), bidi overrides (U+202E reverses what follows) and
line separators. ``list``, ``status``, ``history`` and ``check`` print each of them as an escape
(``\\x1b``, ``\\n``, ``\\u202e``, ``\\u2028``); the only control character left in their output is
the newline between lines, so every table has exactly its own rows.

In-process through click's runner, on SQLite: the behaviour is the output's, not the server's.
"""
from __future__ import annotations

import json
import unicodedata
import uuid
from datetime import timedelta

import pytest
import sqlalchemy as sa
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_cluster_beat import every
from celery_cluster_beat.ops.cli import cluster_beat
from celery_cluster_beat.store import ClaimStore
from celery_cluster_beat.store.schema import (claims_table, controls_table, nodes_table, schedules_table,
                                              stored_schedules_table)

EVIL = "evil\x1b[2J\nfake  row  config  enabled"
PAUSED = "held\u2028\x9b31m"
NODE = "host\u202e\x1b[5m"
CLAIMANT = "node\x1b]0;pwned\x07"
REASON = "boom\x1b[2J\nline two"
DESCRIPTION = "\u202eevil\x1b[31m"
OWNER = "own\x1b[5m\u200d"
NOTE = "why\x1b[2J\u202e\nfake"  # written past the API (which refuses it)


def invoke(app: Celery, *args: str) -> Result:
    return CliRunner().invoke(cluster_beat, list(args), obj=CLIContext(app=app, no_color=True, workdir=None,
                                                                        quiet=False))


def unprintable(text: str) -> list:
    """The characters of *text* a terminal would act on (the newlines between lines aside)."""
    return [c for c in text if c != "\n" and unicodedata.category(c) in ("Cc", "Cf", "Cs", "Zl", "Zp")]


def prepared(db_url: str):
    """Prepare the claim database as beat would (tables, schema version) and return its time to the
    second, for rows written past the API afterwards."""
    store = ClaimStore(db_url, node_id="beat-1")
    store.open()
    try:
        return store.db_now().replace(microsecond=0)
    finally:
        store.close()


@pytest.fixture(scope="module")
def hostile(tmp_path_factory):
    """A claim database whose rows hold everything above; the app that reads it."""
    path = tmp_path_factory.mktemp("escaping") / "claims.sqlite3"
    db_url = f"sqlite:///{path}"
    now = prepared(db_url)
    engine = sa.create_engine(db_url)
    with engine.begin() as conn:
        conn.execute(sa.insert(stored_schedules_table).values(
            name=EVIL, task="t.record", schedule="every 60s", zone=None, args="[]", kwargs="{}", options="{}",
            description=DESCRIPTION, owner=OWNER, enabled=True, deleted=False, version=1, created_at=now,
            changed_at=now, next_at=None))
        conn.execute(sa.insert(controls_table).values(name=PAUSED, paused=True, paused_at=now,
                                                      paused_by="op\x1b[2J", paused_note=NOTE, version=1))
        conn.execute(sa.insert(controls_table).values(name="tick", paused=True, paused_at=now,
                                                      paused_by="op\x1b[2J", paused_note=NOTE, version=1))
        conn.execute(sa.insert(nodes_table).values(node=NODE, started_at=now, heartbeat_at=now, scheduling=True))
        conn.execute(sa.insert(claims_table), [
            dict(schedule=EVIL, scheduled_at=now - timedelta(minutes=m), claimed_at=now - timedelta(minutes=m),
                 node=CLAIMANT, task_id=str(uuid.uuid4()), status=status, reason=REASON, attempts=5)
            for m, status in ((2, "failed"), (10, "claimed"))])
        conn.execute(sa.insert(schedules_table).values(name=EVIL, last_error="err\x1b[2J", updated_at=now))
    engine.dispose()
    app = Celery("escaping", broker="memory://", set_as_current=False)
    app.conf.update(cluster_beat_db_url=db_url, cluster_beat_redis_url="",
                    beat_schedule={"tick": {"task": "t.record", "schedule": every(60)}})
    return app


def test_list_shows_a_hostile_stored_name_escaped_on_one_row(hostile):
    for wide in ((), ("--wide",)):
        r = invoke(hostile, "list", *wide)
        assert r.exit_code == 0, r.output
        assert unprintable(r.output) == [], r.output
        sections = r.output.split("\n\n")
        table = sections[0].splitlines()
        assert len(table) == 3, r.output  # the header, tick, and the hostile row: no fake row
        assert table[2].startswith("evil\\x1b[2J\\nfake  row  config  enabled  "), table
        after_name = "t.record" if wide else "invalid"  # --wide: TASK next; else STATE
        assert table[2].split("  ")[:5] == ["evil\\x1b[2J\\nfake", "row", "config", "enabled", after_name], table
        # tick is paused; who paused it and why are stored text too: escaped, one line.
        shown = "\n".join(sections)
        assert "op\\x1b[2J" in shown and "why\\x1b[2J\\u202e\\nfake" in shown, r.output
        assert len([line for line in shown.splitlines() if "why" in line]) == 1, r.output  # its row or PAUSED


def test_status_shows_hostile_node_names_paused_names_and_reasons_escaped(hostile):
    r = invoke(hostile, "status")
    assert r.exit_code == 0, r.output
    assert unprintable(r.output) == [], r.output
    assert "host\\u202e\\x1b[5m" in r.output
    assert "2 paused: held\\u2028\\x9b31m, tick" in r.output
    notes = [line for line in r.output.splitlines() if "why\\x1b[2J\\u202e\\nfake" in line]
    assert len(notes) == 2 and notes[0].startswith("held\\u2028\\x9b31m  op\\x1b[2J  "), notes
    unsent = [line for line in r.output.splitlines() if line.startswith("evil")]
    assert len(unsent) == 1 and "node\\x1b]0;pwned\\x07" in unsent[0] and "boom\\x1b[2J\\nline two" in unsent[0]


def test_history_shows_hostile_nodes_and_errors_escaped(hostile):
    r = invoke(hostile, "history", EVIL)
    assert r.exit_code == 0, r.output
    assert unprintable(r.output) == [], r.output
    rows = r.output.splitlines()
    assert len(rows) == 3, r.output  # the header and the two occurrences
    paused = invoke(hostile, "history", "tick")
    assert unprintable(paused.output) == [] and paused.output.splitlines()[0] == (
        "tick is paused by op\\x1b[2J since " + paused.output.splitlines()[0].split(" since ")[1]), paused.output
    assert paused.output.splitlines()[0].endswith(": why\\x1b[2J\\u202e\\nfake"), paused.output
    assert all("node\\x1b]0;pwned\\x07" in row for row in rows[1:])
    assert "boom\\x1b[2J\\nline two" in rows[1]  # the failed one's reason


def test_check_and_json_output_escape_them_too(hostile):
    r = invoke(hostile, "check")
    assert unprintable(r.output) == [], r.output
    assert "evil\\x1b[2J\\nfake" in r.output  # the hostile row is named, escaped
    for args in (["list", "--json"], ["status", "--json"], ["history", EVIL, "--json"]):
        out = invoke(hostile, *args)
        assert out.exit_code == 0 and unprintable(out.output) == [], (args, out.output)
        json.loads(out.output)
    listed = {s["name"]: s for s in json.loads(invoke(hostile, "list", "--json").output)}
    assert (listed[EVIL]["description"], listed[EVIL]["owner"]) == (DESCRIPTION, OWNER)  # JSON keeps the text
