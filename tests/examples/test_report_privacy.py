"""The report example keeps its users' data to the snapshot (issue 20, item 9).

* A masked column is masked in the query: its value never reaches the worker, so a value the
  driver cannot convert (a DATETIME column holding a secret) can no longer carry the secret into
  the failure message, the export row and the owner's notification.
* A row that cannot be exported is named by its number and the error's class, never its values.
* Snapshots are 0600 in folders of mode 0700, whatever the umask.

In-process, on SQLite: ``write_snapshot`` is what a run calls; the end-to-end runs are in
``test_reports.py``.
"""
from __future__ import annotations

import csv
import importlib
import os
import stat
import sys

import pytest
import sqlalchemy as sa

import procs

EXAMPLES = procs.REPO / "examples"
SECRET = "hunter2-secret-token"


def mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


@pytest.fixture
def tasks(tmp_path, monkeypatch):
    """The example's task module (its settings, read once at import, point into *tmp_path*)."""
    monkeypatch.syspath_prepend(str(EXAMPLES))
    if "reports.tasks" not in sys.modules:
        monkeypatch.setenv("REPORTS_DATA_DIR", str(tmp_path / "imported"))
        monkeypatch.delenv("REPORTS_OUTPUT_DIR", raising=False)
    return importlib.import_module("reports.tasks")


@pytest.fixture
def engine(tmp_path):
    engine = sa.create_engine(f"sqlite:///{tmp_path}/app.sqlite3")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE TABLE secrets (id INTEGER PRIMARY KEY, email TEXT, token DATETIME)")
        conn.exec_driver_sql("INSERT INTO secrets VALUES (1, 'ada@example.org', ?), (2, NULL, NULL)", (SECRET,))
    yield engine
    engine.dispose()


def test_a_masked_column_is_masked_before_it_is_converted(tasks, engine, tmp_path):
    path = tmp_path / "out" / "report-1" / "snap.csv"
    rows, size = tasks.write_snapshot(engine, "secrets", ["token", "email"], path)
    with open(path, newline="") as f:
        assert list(csv.reader(f)) == [["id", "email", "token"], ["1", "***", "***"], ["2", "", ""]]
    assert (rows, size) == (2, path.stat().st_size) and SECRET not in path.read_text()


def test_a_row_that_cannot_be_exported_is_named_without_its_values(tasks, engine, tmp_path):
    path = tmp_path / "out" / "report-1" / "snap.csv"
    with pytest.raises(tasks.ReportFailed) as info:
        tasks.write_snapshot(engine, "secrets", ["email"], path)  # token unmasked: its text is no DATETIME
    assert str(info.value) == "row 1 of table secrets could not be exported (ValueError; its values are not shown)"
    assert info.value.__cause__ is None and info.value.__suppress_context__  # no traceback shows the original
    assert list(path.parent.iterdir()) == []  # nothing half-written left behind


def test_snapshots_are_0600_in_0700_folders_whatever_the_umask(tasks, engine, tmp_path):
    from reports.settings import Settings

    old = os.umask(0)  # SQLite, open() and mkdir() alone would give 0644 / 0777
    try:
        settings = Settings.from_env({"REPORTS_DATA_DIR": str(tmp_path / "data")})
        path = settings.output_dir / "report-7" / "snap.csv"
        tasks.write_snapshot(engine, "secrets", ["token"], path)
    finally:
        os.umask(old)
    assert mode(path) == 0o600
    for folder in (path.parent, settings.output_dir, settings.data_dir):
        assert mode(folder) == 0o700, (folder, oct(mode(folder)))
