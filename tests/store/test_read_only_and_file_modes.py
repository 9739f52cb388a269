"""A store opened read-only writes nothing; a SQLite claim file and its WAL are the owner's alone
(issue 20, items 6 and 9).

* ``ClaimStore(..., read_only=True)`` (operators' reads) checks the schema instead of preparing
  it, refuses any call that writes before it reaches the database (``ReadOnlyStore``, saying how
  to open a store that writes), and its sessions are read-only on the server too: a write that
  slipped past is refused there (PostgreSQL, MariaDB, SQLite's ``query_only``). On a database no
  beat prepared it raises ``StoreNotInitialised`` and leaves it as it was; a missing SQLite file
  is not created. An older schema is ``OlderSchema``, whatever rows it has.
* ``ClaimStore(..., prepare=False)`` (operators' writes) writes, but opens like a read: an empty
  database or a missing SQLite file is ``StoreNotInitialised`` and stays as it was, an older
  schema is ``OlderSchema`` and is not migrated.
* A claim file the store creates is 0600 whatever the umask, and SQLite gives its ``-wal`` and
  ``-shm`` files the same mode; a file that exists keeps its own.
"""
from __future__ import annotations

import os
import stat
from contextlib import contextmanager
from datetime import timedelta
from typing import Iterator

import pytest
import sqlalchemy as sa

from celery_cluster_beat.schedules.occurrence import Occurrence
from celery_cluster_beat.store import SCHEMA_VERSION, ClaimStore
from celery_cluster_beat.errors import ConfigError
from celery_cluster_beat.store.errors import OlderSchema, ReadOnlyStore, StoreNotInitialised
from celery_cluster_beat.store.schema import meta_table


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@contextmanager
def umask(value: int) -> Iterator[None]:
    old = os.umask(value)
    try:
        yield
    finally:
        os.umask(old)


def test_a_read_only_store_refuses_writes_and_so_does_its_server_session(make_store, raw):
    make_store("beat-1")  # prepares the schema
    store = make_store("ops", read_only=True)
    assert store.cluster_id and store.overview(grace=10).schema_version == SCHEMA_VERSION
    with pytest.raises(ReadOnlyStore, match=r"was opened read-only and does not write: open it with "
                                            r"celery_cluster_beat\.ops\.report\.open_store\(app, write=True\)"):
        store.set_paused("tick", True)
    assert issubclass(ReadOnlyStore, ConfigError)

    def insert(conn) -> None:  # a write the store's own guard is told is a read
        conn.execute(sa.insert(meta_table).values(key="x", value="y"))

    with pytest.raises(Exception) as info:
        store._run(insert, write=False)
    assert any(w in str(info.value).lower() for w in ("read-only", "read only", "readonly")), info.value
    with raw.connect() as conn:
        assert conn.execute(sa.select(meta_table.c.key).where(meta_table.c.key == "x")).all() == []


def test_a_read_only_store_on_an_empty_database_raises_and_creates_nothing(db_url, raw):
    store = ClaimStore(db_url, node_id="ops", read_only=True)
    with pytest.raises(StoreNotInitialised, match="^not initialised yet: no "):
        store.open()
    assert sa.inspect(raw).get_table_names() == []


def test_a_store_that_writes_without_preparing_refuses_an_empty_database_and_creates_nothing(db_url, raw):
    store = ClaimStore(db_url, node_id="ops", prepare=False)
    with pytest.raises(StoreNotInitialised, match="^not initialised yet: no "):
        store.open()
    assert sa.inspect(raw).get_table_names() == []


def test_a_store_that_writes_without_preparing_writes_into_a_prepared_database(make_store):
    make_store("beat-1")
    store = make_store("ops", prepare=False)
    assert store.set_paused("tick", True, by="me")[1] is True
    assert [c.name for c in store.controls(["tick"]) if c.paused] == ["tick"]


@pytest.mark.parametrize("kind", [dict(read_only=True), dict(prepare=False)])
def test_a_store_that_does_not_prepare_does_not_create_a_missing_sqlite_file(tmp_path, kind):
    path = tmp_path / "claims.sqlite3"
    with pytest.raises(StoreNotInitialised, match=f"no claim database file at {path}"):
        ClaimStore(f"sqlite:///{path}", node_id="ops", **kind).open()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("kind", [dict(read_only=True), dict(prepare=False)])
@pytest.mark.parametrize("cluster_id", [True, False])
def test_an_older_schema_is_named_and_not_migrated_whatever_rows_it_has(make_store, raw, db_url, kind, cluster_id):
    make_store("old-beat")
    with raw.begin() as conn:
        conn.execute(sa.update(meta_table).where(meta_table.c.key == "schema_version")
                     .values(value=str(SCHEMA_VERSION - 1)))
        if not cluster_id:  # as a release may have left it that recorded no cluster id
            conn.execute(sa.delete(meta_table).where(meta_table.c.key == "cluster_id"))
    with raw.connect() as conn:
        before = sorted(conn.execute(sa.select(meta_table.c.key, meta_table.c.value)).all())
    store = ClaimStore(db_url, node_id="ops", **kind)
    with pytest.raises(OlderSchema, match=f"has schema version {SCHEMA_VERSION - 1}, older than version "
                                          f"{SCHEMA_VERSION} .*only beat migrates it"):
        store.open()
    with raw.connect() as conn:
        assert sorted(conn.execute(sa.select(meta_table.c.key, meta_table.c.value)).all()) == before


def test_a_read_only_store_cannot_be_asked_to_prepare():
    with pytest.raises(ValueError, match="cannot prepare"):
        ClaimStore("sqlite://", node_id="ops", read_only=True, prepare=True)


def test_a_new_claim_file_and_its_wal_and_shm_are_0600_whatever_the_umask(tmp_path):
    path = tmp_path / "claims.sqlite3"
    with umask(0):  # nothing taken off: SQLite alone would make the file 0644 (and its WAL with it)
        store = ClaimStore(f"sqlite:///{path}", node_id="beat-1")
        store.open()
        try:
            now = store.db_now()
            store.claim([Occurrence("tick", now - timedelta(seconds=1))])
            store.heartbeat(scheduling=True, register=True)
            files = {p.name: mode(p) for p in tmp_path.iterdir()}
        finally:
            store.close()
    assert files == {"claims.sqlite3": 0o600, "claims.sqlite3-wal": 0o600, "claims.sqlite3-shm": 0o600}, \
        {k: oct(v) for k, v in files.items()}


def test_a_claim_file_that_exists_keeps_its_mode(tmp_path):
    path = tmp_path / "claims.sqlite3"
    path.touch()
    os.chmod(path, 0o640)  # the operator's choice (a group that reads it)
    store = ClaimStore(f"sqlite:///{path}", node_id="beat-1")
    store.open()
    store.close()
    assert mode(path) == 0o640
