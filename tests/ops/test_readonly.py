"""Operators' reads never write, and no operators' command creates or migrates the schema:
``cluster-beat status | list | history | check`` open the claim store read-only, ``pause | resume |
run-now | prune`` write rows only into tables a beat prepared (issue 20, item 6).

They used to prepare the schema like beat: with a SELECT-only role reads failed (an INSERT of the
meta rows), on an empty database ``status`` created the tables and a cluster id of its own, and a
``pause`` against a mistyped URL created them too and reported success. Here, against real
SQLite, PostgreSQL and MariaDB:

* through a role that has SELECT and nothing else, every read works and afterwards every table,
  its columns and its rows are exactly what they were (while ``pause``, a write, is refused);
* on an empty database (as the superuser: even with every right, nothing is created) every
  command but ``check`` prints one line ``not initialised yet: ...`` with the password masked and
  exits 3; ``check`` passes, saying the store is reachable and not initialised yet (a deploy runs
  it before the first beat); the database is still empty;
* an older schema is named and not migrated, by reads and writes alike;
* the Python API's store is read-only unless asked: a write on it is a ``ReadOnlyStore`` error
  that says how to open it for writing.

The commands run in-process through click's runner (a ``celery`` process costs about a second
of CPU); what they print and return is what a terminal gets.
"""
from __future__ import annotations

import json
import uuid
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path
from typing import Dict, Iterator, List, Tuple

import pytest
import sqlalchemy as sa
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result
from sqlalchemy.engine import make_url

from celery_cluster_beat import every
from celery_cluster_beat.dynamic import StoredSchedules
from celery_cluster_beat.errors import ConfigError
from celery_cluster_beat.ops.cli import NOT_INITIALISED, cluster_beat
from celery_cluster_beat.ops.report import open_store
from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.store import SCHEMA_VERSION, ClaimStore
from celery_cluster_beat.store.errors import ReadOnlyStore
from celery_cluster_beat.store.schema import metadata

#: Every table a prepared claim database has.
TABLES = len(metadata.tables)

PASSWORD = "ro-s3cret"
READS = (["status"], ["status", "--json"], ["list"], ["list", "--json"], ["history", "tick"],
         ["history", "tick", "--json"])
WRITES = (["pause", "tick"], ["resume", "tick"], ["run-now", "tick"], ["prune"], ["pause", "tick", "--json"])


def make_app(db_url: str) -> Celery:
    app = Celery(f"ro_{uuid.uuid4().hex[:8]}", broker="memory://", set_as_current=False)
    app.conf.update(cluster_beat_db_url=db_url, cluster_beat_redis_url="",
                    beat_schedule={"tick": {"task": "t.record", "schedule": every(60)}})
    return app


def invoke(app: Celery, *args: str) -> Result:
    return CliRunner().invoke(cluster_beat, list(args), obj=CLIContext(app=app, no_color=True, workdir=None,
                                                                        quiet=False))


def snapshot(url: str) -> Dict[str, Tuple[List[Tuple[str, str]], List[Tuple[str, ...]]]]:
    """Every table of the database at *url*: its columns and types, and its rows (as text, sorted)."""
    engine = sa.create_engine(url)
    try:
        out = {}
        inspector = sa.inspect(engine)
        with engine.connect() as conn:
            for name in sorted(inspector.get_table_names()):
                columns = [(c["name"], str(c["type"])) for c in inspector.get_columns(name)]
                rows = sorted(tuple(map(str, r)) for r in conn.execute(sa.text(f"SELECT * FROM {name}")))
                out[name] = (columns, rows)
        return out
    finally:
        engine.dispose()


@contextmanager
def select_only_role(admin_url: str) -> Iterator[str]:
    """A login role (user) of its own that may SELECT the database's tables and do nothing else;
    yields its URL (with a password, which output must mask)."""
    url = make_url(admin_url)
    role = f"ccb_ro_{uuid.uuid4().hex[:10]}"
    engine = sa.create_engine(admin_url, isolation_level="AUTOCOMMIT")
    postgres = url.get_backend_name() == "postgresql"
    try:
        with engine.connect() as conn:
            if postgres:
                conn.exec_driver_sql(f"CREATE ROLE {role} LOGIN PASSWORD '{PASSWORD}'")
                conn.exec_driver_sql(f"GRANT SELECT ON ALL TABLES IN SCHEMA public TO {role}")
            else:
                conn.execute(sa.text(f"CREATE USER '{role}'@'%' IDENTIFIED BY '{PASSWORD}'"))
                conn.execute(sa.text(f"GRANT SELECT ON `{url.database}`.* TO '{role}'@'%'"))
        yield url.set(username=role, password=PASSWORD).render_as_string(hide_password=False)
    finally:
        with engine.connect() as conn:
            if postgres:
                conn.exec_driver_sql(f"DROP OWNED BY {role}")
                conn.exec_driver_sql(f"DROP ROLE {role}")
            else:
                conn.execute(sa.text(f"DROP USER IF EXISTS '{role}'@'%'"))
        engine.dispose()


def fill(db_url: str, app: Celery) -> None:
    """What a running cluster leaves: the tables, a node's heartbeat, claim rows, a stored
    schedule, a paused one."""
    store = ClaimStore(db_url, node_id="beat-1")
    store.open()
    try:
        store.heartbeat(scheduling=True, register=True)
        now = store.db_now().replace(microsecond=0)
        store.claim([Occurrence("tick", now - timedelta(minutes=1))])
        store.record([Occurrence("tick", now - timedelta(minutes=2))], status="missed", reason="test")
        store.set_paused("tick", True, by="alice@ops")
    finally:
        store.close()
    with StoredSchedules(app) as api:
        api.add("report:1", "t.record", every(300), owner="alice", description="a stored one")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("db_url", ["postgresql", "mysql"], indirect=True)
def test_every_read_works_through_a_select_only_role_and_writes_nothing(db_url):
    fill(db_url, make_app(db_url))
    with select_only_role(db_url) as ro_url:
        before = snapshot(db_url)
        assert len(before) == TABLES and before["cluster_beat_claims"][1], sorted(before)
        app = make_app(ro_url)
        for args in READS:
            r = invoke(app, *args)
            assert r.exit_code == 0, (args, r.output, r.exception)
            assert PASSWORD not in r.output
        listed = invoke(app, "list").output
        assert "report:1" in listed and "tick" in listed and "paused" in listed, listed
        status = invoke(app, "status").output
        assert f"(schema {SCHEMA_VERSION})" in status and "beat-1" in status and "tick" in status, status
        assert "missed" in invoke(app, "history", "tick").output
        check = invoke(app, "check")
        assert check.exit_code == 0, check.output
        assert f"ok       claim store: {make_url(ro_url).render_as_string(hide_password=True)}" in check.output
        # The role really is SELECT-only: a write is refused by the server.
        refused = invoke(app, "pause", "tick")
        assert refused.exit_code == 1 and refused.output.startswith("error: "), refused.output
        assert snapshot(db_url) == before


@pytest.mark.timeout(120)
@pytest.mark.parametrize("db_url", ["sqlite", "postgresql", "mysql"], indirect=True)
def test_on_an_empty_database_every_command_says_not_initialised_and_creates_nothing(db_url):
    url = make_url(db_url)
    if url.get_backend_name() == "sqlite":
        Path(url.database).touch()  # an empty file: a database without tables
        folder = sorted(p.name for p in Path(url.database).parent.iterdir())
    elif url.get_backend_name() == "postgresql":
        url = url.set(password=PASSWORD)  # the server trusts the tests' connections: the password is only shown
    app = make_app(url.render_as_string(hide_password=False))
    masked = url.render_as_string(hide_password=True)
    line = f"not initialised yet: no cluster-beat tables in {masked}; start a beat first\n"
    for args in READS + WRITES:
        r = invoke(app, *args)
        assert (r.exit_code, r.stdout, r.stderr) == (NOT_INITIALISED, "", line), (args, r.output, r.exception)
    check = invoke(app, "check")
    assert check.exit_code == 0, check.output  # a deploy runs it before the first beat: no problem
    assert (f"ok       claim store: {masked} reachable, not initialised yet: the first beat creates the tables\n"
            in check.stdout), check.output
    assert PASSWORD not in check.output
    doc = json.loads(invoke(app, "check", "--json").stdout)
    assert doc["ok"] is True and {"check": "claim store", "ok": True, "detail": f"{masked} reachable, not "
                                  "initialised yet: the first beat creates the tables"} in doc["checks"]
    assert snapshot(db_url) == {}
    if url.get_backend_name() == "sqlite":
        assert Path(url.database).stat().st_size == 0
        assert sorted(p.name for p in Path(url.database).parent.iterdir()) == folder


def test_an_older_schema_is_named_and_left_as_it_is(tmp_path):
    db_url = f"sqlite:///{tmp_path}/claims.sqlite3"
    with ClaimStore(db_url, node_id="old-beat"):
        pass
    engine = sa.create_engine(db_url)
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE cluster_beat_meta SET value = ? WHERE key = 'schema_version'",
                             (str(SCHEMA_VERSION - 1),))
    before = snapshot(db_url)
    for args in (["status"], ["pause", "tick"], ["prune"]):
        r = invoke(make_app(db_url), *args)
        assert r.exit_code == 1, (args, r.output)
        assert r.stderr == (f"error: the claim database sqlite:///{tmp_path}/claims.sqlite3 has schema version "
                            f"{SCHEMA_VERSION - 1}, older than version {SCHEMA_VERSION} of this "
                            "celery-cluster-beat; only beat migrates it: start a beat of this release (it "
                            "migrates the schema on start-up), then try again\n"), (args, r.stderr)
    checked = invoke(make_app(db_url), "check")  # a deploy checks before its beats migrate: not its problem
    assert f"claim store: sqlite:///{tmp_path}/claims.sqlite3 reachable, schema {SCHEMA_VERSION - 1}: the first " \
        f"beat of this release migrates it to {SCHEMA_VERSION}" in checked.stdout, checked.output
    assert snapshot(db_url) == before
    engine.dispose()


def test_writes_go_into_a_prepared_database(tmp_path):
    db_url = f"sqlite:///{tmp_path}/claims.sqlite3"
    with ClaimStore(db_url, node_id="beat-1"):
        pass
    app = make_app(db_url)
    r = invoke(app, "pause", "tick")
    assert r.exit_code == 0 and "paused 'tick'" in r.output, r.output
    assert "1 paused: tick" in invoke(app, "status").output
    assert invoke(app, "run-now", "tick").exit_code == 0
    assert invoke(app, "prune").exit_code == 0


def test_the_api_store_is_read_only_unless_asked_and_a_write_on_it_says_how(tmp_path):
    db_url = f"sqlite:///{tmp_path}/claims.sqlite3"
    with ClaimStore(db_url, node_id="beat-1"):
        pass
    app = make_app(db_url)
    store = open_store(app)
    try:
        with pytest.raises(ReadOnlyStore, match=r"open_store\(app, write=True\)") as err:
            store.set_paused("tick", True, by="me")
        assert isinstance(err.value, ConfigError)
    finally:
        store.close()
    store = open_store(app, write=True)
    try:
        assert store.set_paused("tick", True, by="me")[1] is True
    finally:
        store.close()
