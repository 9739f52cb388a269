"""``cluster-beat check`` is read-only and strict (issue 21, item 5).

Read-only: on every dialect a claim store that does not exist yet is reported the same way and
is no problem (``not initialised yet: the first beat creates the tables``), and ``check`` leaves
it as it found it: an empty PostgreSQL or MariaDB database still has no table at all (asked of
``information_schema``, not of our own code), a missing SQLite file is not created. What beat
could not get past is a problem: a SQLite folder that does not exist or cannot be written, an
unreachable server.

Strict: a ``cluster_beat_*`` key that no release reads (``cluster_beat_lock_tll``) used to pass
silently, its default in force; now it is a problem naming the closest setting, and beat warns
about it at start-up (tests/beat/test_startup_warnings.py). The known names are derived from the
settings' declarations; a test below holds them to every setting the package reads and to the
README's table. Celery / kombu outside the tested range: a warning line (still ``ok``); below
what the package supports: a problem. A lease whose Redis names another claim store (beat would
refuse to start) is a problem naming ``adopt-store``.

Commands run in this process through click's runner, against real databases and Redis.
"""
from __future__ import annotations

import configparser
import json
import os
import re
import uuid
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result
from sqlalchemy.engine import make_url

from celery_cluster_beat import every
from celery_cluster_beat.config.settings import known_settings, unknown_settings
from celery_cluster_beat.leader.lease import RedisLease, cluster_key
from celery_cluster_beat.messages import support
from celery_cluster_beat.ops import checks
from celery_cluster_beat.ops.cli import cluster_beat
from celery_cluster_beat.store import ClaimStore

REPO = Path(__file__).resolve().parents[2]
NOTE = "not initialised yet: the first beat creates the tables"


def make_app(db_url: str, redis_url: str = "", **conf) -> Celery:
    app = Celery(f"strict_{uuid.uuid4().hex[:8]}", broker="memory://", set_as_current=False)
    app.conf.update(cluster_beat_db_url=db_url, cluster_beat_redis_url=redis_url,
                    beat_schedule={"tick": {"task": "t.record", "schedule": every(60)}}, **conf)
    return app


def invoke(app: Celery, *args: str) -> Result:
    try:
        runner = CliRunner(mix_stderr=False)  # click < 8.2 mixes stderr into stdout by default
    except TypeError:
        runner = CliRunner()
    return runner.invoke(cluster_beat, list(args), obj=CLIContext(app=app, no_color=True, workdir=None, quiet=False))


def lines(r: Result, kind: str, check: str):
    return [line for line in (r.stdout + r.stderr).splitlines() if line.startswith(kind) and f" {check}:" in line]


def tables_in(url: str) -> list:
    """Every table of the database at *url*, from information_schema (whatever our code thinks)."""
    engine = sa.create_engine(url)
    database = make_url(url).database
    try:
        with engine.connect() as conn:
            if make_url(url).get_backend_name() == "postgresql":
                rows = conn.execute(sa.text("SELECT table_schema, table_name FROM information_schema.tables WHERE "
                                            "table_catalog = :db AND table_schema NOT IN "
                                            "('pg_catalog', 'information_schema')"), {"db": database})
            else:
                rows = conn.execute(sa.text("SELECT table_schema, table_name FROM information_schema.tables "
                                            "WHERE table_schema = :db"), {"db": database})
            return sorted(tuple(r) for r in rows)
    finally:
        engine.dispose()


# ----------------------------------------------------------------------------- read-only


@pytest.mark.timeout(120)
@pytest.mark.parametrize("db_url", ["postgresql", "mysql"], indirect=True)
def test_an_empty_server_database_passes_and_stays_empty(db_url):
    assert tables_in(db_url) == []
    app = make_app(db_url)
    for args in (["check"], ["check", "--json"]):
        r = invoke(app, *args)
        assert r.exit_code == 0, (r.stdout, r.stderr)
    assert lines(invoke(app, "check"), "ok", "claim store") == [
        f"ok       claim store: {make_url(db_url).render_as_string(hide_password=True)} reachable, {NOTE}"]
    assert tables_in(db_url) == []  # not one table, sequence or view: check wrote nothing


def test_a_missing_sqlite_file_passes_like_an_empty_database_and_is_not_created(tmp_path):
    """It used to be a problem (``no claim database at ...``) where an empty PostgreSQL database passed."""
    path = tmp_path / "claims.sqlite3"
    app = make_app(f"sqlite:///{path}")
    r = invoke(app, "check")
    assert r.exit_code == 0, (r.stdout, r.stderr)
    assert lines(r, "ok", "claim store") == [
        f"ok       claim store: sqlite:///{path} not created yet (its folder is writable), {NOTE}"]
    doc = json.loads(invoke(app, "check", "--json").stdout)
    assert doc["ok"] is True
    assert sorted(os.listdir(tmp_path)) == []  # no file, no -wal, no -shm


def test_a_sqlite_folder_beat_cannot_create_the_file_in_is_a_problem(tmp_path):
    missing = tmp_path / "nowhere" / "claims.sqlite3"
    r = invoke(make_app(f"sqlite:///{missing}"), "check")
    assert r.exit_code == 1, r.stdout
    assert lines(r, "problem", "claim store") == [
        f"problem  claim store: sqlite:///{missing}: the folder {missing.parent} does not exist, and beat does not "
        "create folders; create it (writable by beat's user) or set cluster_beat_db_url"]
    assert not missing.parent.exists()


def test_an_unreachable_server_is_still_a_problem():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = invoke(make_app(f"postgresql+psycopg://postgres:pw@127.0.0.1:{port}/nowhere"), "check")
    assert r.exit_code == 1
    assert len(lines(r, "problem", "claim store")) == 1 and "pw@" not in r.stderr, r.stderr


# ----------------------------------------------------------------------------- unknown settings


def test_a_misspelt_setting_is_a_problem_naming_the_setting_meant(tmp_path):
    db_url = f"sqlite:///{tmp_path}/claims.sqlite3"
    app = make_app(db_url, cluster_beat_lock_tll=30, cluster_beat_http_prot=8080, cluster_beat_lock_ttl=7,
                   cluster_beat_frobnicate=1, my_own_setting=1)
    r = invoke(app, "check")
    assert r.exit_code == 1, (r.stdout, r.stderr)
    assert lines(r, "problem", "settings") == [
        "problem  settings: setting cluster_beat_frobnicate: not a setting celery-cluster-beat reads, so it is "
        "ignored (the README's Settings table lists them)",
        "problem  settings: setting cluster_beat_http_prot: not a setting celery-cluster-beat reads, so it is "
        "ignored; did you mean cluster_beat_http_port?",
        "problem  settings: setting cluster_beat_lock_tll: not a setting celery-cluster-beat reads, so it is "
        "ignored; did you mean cluster_beat_lock_ttl?",
    ]
    assert lines(r, "ok", "settings") == []
    assert invoke(make_app(db_url, cluster_beat_lock_ttl=7), "check").exit_code == 0


def test_settings_as_celery_reads_them_upper_case_and_namespaced(tmp_path):
    module = tmp_path / f"conf_{uuid.uuid4().hex[:8]}.py"
    module.write_text("CLUSTER_BEAT_LOCK_TTL = 30\ncluster_beat_claim_grace = 9\n")
    namespaced = tmp_path / f"django_{uuid.uuid4().hex[:8]}.py"
    namespaced.write_text("CELERY_CLUSTER_BEAT_LOCK_TTL = 30\nCELERY_CLUSTER_BEAT_CLAIM_GRAC = 9\n"
                          "CELERY_BROKER_URL = 'memory://'\nDATABASES = {}\n")
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        plain = Celery("plain", set_as_current=False)
        plain.config_from_object(module.stem)
        assert plain.conf.get("cluster_beat_lock_ttl") is None  # Celery really ignores it
        assert unknown_settings(plain.conf) == [
            "setting CLUSTER_BEAT_LOCK_TTL: Celery reads settings in lower case, so it is ignored; did you mean "
            "cluster_beat_lock_ttl?"]
        django = Celery("django", set_as_current=False)
        django.config_from_object(namespaced.stem, namespace="CELERY")
        assert django.conf.get("cluster_beat_lock_ttl") == 30  # the namespace is how Celery reads these
        assert unknown_settings(django.conf) == [
            "setting CELERY_CLUSTER_BEAT_CLAIM_GRAC: not a setting celery-cluster-beat reads, so it is ignored; "
            "did you mean CELERY_CLUSTER_BEAT_CLAIM_GRACE?"]
    finally:
        sys.path.remove(str(tmp_path))


def test_the_known_settings_are_every_setting_the_package_reads_and_the_readme_lists():
    """Derived from the declarations (Settings' fields): a setting read anywhere in the package, or
    a row of the README's Settings table, that is not known would be reported as misspelt."""
    package = REPO / "celery_cluster_beat"
    read = set()
    for path in package.rglob("*.py"):
        # conf.get("cluster_beat_x"), and get("cluster_beat_x") with get = conf.get (config/settings.py)
        read |= set(re.findall(r"""(?:conf\.|(?<![\w.]))get\(\s*["'](cluster_beat_[a-z0-9_]+)["']""", path.read_text()))
        read |= set(re.findall(r"""^SETTING = ["'](cluster_beat_[a-z0-9_]+)["']""", path.read_text(), re.M))
    assert read and read <= known_settings(), sorted(read - known_settings())
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    table = set(re.findall(r"^\| `(cluster_beat_[a-z0-9_]+)` \|", section, re.M))
    assert table == known_settings(), (sorted(table - known_settings()), sorted(known_settings() - table))


# ----------------------------------------------------------------------------- versions


@pytest.mark.parametrize("celery_version, ok, line", [
    ("5.8.1", True, "warning: celery 5.8.1 is newer than the tested range 5.3-5.7: supported, but no CI run has "
                    "watched it send"),
    ("6.0.0", True, "warning: celery 6.0.0 is newer than the tested range 5.3-5.7: supported, but no CI run has "
                    "watched it send"),
    ("5.2.7", False, "celery 5.2.7 is older than 5.3, the oldest this celery-cluster-beat supports (the tested "
                     "range 5.3-5.7)"),
])
def test_versions_outside_the_tested_range_warn_and_below_the_minimum_fail(monkeypatch, tmp_path, celery_version,
                                                                          ok, line):
    """It used to fail for any version outside the table: a newer Celery is supported (the fast path
    checks itself and falls back), and failing a deploy for it is wrong."""
    monkeypatch.setattr(support, "installed", lambda: [("celery", celery_version), ("kombu", "5.7.0")])
    r = invoke(make_app(f"sqlite:///{tmp_path}/claims.sqlite3"), "check")
    assert r.exit_code == (0 if ok else 1), (r.stdout, r.stderr)
    assert lines(r, "ok" if ok else "problem", "versions") == [f"{'ok     ' if ok else 'problem'}  versions: {line}"]


def test_in_range_versions_and_the_minimum_agree_with_setup_cfg():
    assert checks.version_checks() == [("versions", True, support.describe())]
    cfg = configparser.ConfigParser()
    cfg.read(REPO / "setup.cfg")
    minimum = re.search(r"^\s*celery(?:\[[^\]]*\])?\s*>=\s*([\d.]+)", cfg["options"]["install_requires"], re.M)
    assert minimum and support.minor(minimum.group(1)) == checks.SUPPORTED_MINIMUM["celery"]
    assert checks.SUPPORTED_MINIMUM["celery"] <= support.TESTED["celery"][0]


# ----------------------------------------------------------------------------- the lease's store


def test_a_lease_that_serves_another_claim_store_is_a_problem_naming_adopt_store(tmp_path, redis_url):
    name = f"strict-{uuid.uuid4().hex[:8]}"
    db_url = f"sqlite:///{tmp_path}/claims.sqlite3"
    with ClaimStore(db_url, node_id="setup") as store:
        ours = store.cluster_id
    app = make_app(db_url, redis_url, cluster_beat_cluster_name=name)
    client = redis.Redis.from_url(redis_url)
    try:
        r = invoke(app, "check")
        assert r.exit_code == 0 and lines(r, "ok", "redis") == [f"ok       redis: {redis_url}"], (r.stdout, r.stderr)
        other = RedisLease(lambda: redis.Redis.from_url(redis_url), name=name, node_id="old", cluster_id="store-A")
        try:
            assert other.try_acquire()
            other.release()
        finally:
            other.close()
        before = {k: client.get(k) for k in client.keys(f"cluster_beat:{{{name}}}:*") if client.type(k) == b"string"}
        r = invoke(app, "check")
        assert r.exit_code == 1, r.stdout
        (problem,) = lines(r, "problem", "redis")
        assert problem.startswith(f"problem  redis: beat would refuse to start: the lease {name!r} serves claim "
                                  f"store store-A (Redis key {cluster_key(name)} on {redis_url}), but this node's "
                                  f"claim store is {ours}."), problem
        assert "cluster-beat adopt-store`" in problem
        after = {k: client.get(k) for k in client.keys(f"cluster_beat:{{{name}}}:*") if client.type(k) == b"string"}
        assert after == before  # read, nothing written
    finally:
        client.delete(*client.keys(f"cluster_beat:{{{name}}}:*") or ["-"])
        client.close()
