"""Making the database ready on open: create what is missing, migrate an older schema, refuse a newer one.

Every replica opens the store at start-up, often all at once, so preparation
is idempotent and tolerates losing a race: tables are created if absent, the
one-row tables (leader term, schedule change counter) and the meta rows
(schema version, cluster id) are inserted if absent, and a CREATE that another
replica beat us to is retried. A store written by an older release is brought
up to :data:`~.schema.SCHEMA_VERSION` step by step (:data:`~.schema.MIGRATIONS`);
one written by a newer release is refused (:class:`~.errors.SchemaVersionError`)
rather than misread.

Operators' commands (``cluster-beat status | list | history | check``, the status page, and
the writes ``pause | resume | run-now | prune``) only check the schema instead
(:meth:`SchemaPreparation._check_schema`): reads must work with a SELECT-only database role, and a
command that prepared an empty (or mistyped) database would give it tables and a cluster id of its
own, then report another cluster's lease as its leader or "succeed" at a pause no beat reads. So
such an open only looks: an uninitialised database is :class:`~.errors.StoreNotInitialised`, an
older schema :class:`~.errors.OlderSchema` (a beat of this release migrates it: an operator's
command must not change the schema under running replicas of the older release), a newer one
:class:`~.errors.SchemaVersionError`, and nothing is created or migrated.

Mixed into :class:`~.claims.ClaimStore`; :meth:`~.engine.StoreEngine.open` calls
``_prepare_schema`` (or, for operators, ``_check_schema``) with the new engine before any query runs.
"""
from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any, ContextManager

import sqlalchemy as sa
from sqlalchemy.engine import Connection, Engine

from .dialects.base import new_token
from .engine import logger
from .errors import OlderSchema, SchemaVersionError, StoreNotInitialised
from .schema import MIGRATIONS, SCHEMA_VERSION, leader_table, meta_table, metadata, schedule_version_table


class SchemaPreparation:
    """Mixed into :class:`~.claims.ClaimStore`: it provides ``_connection``, ``_now``, ``_dialect``
    and ``url_masked``, and keeps the ``_cluster_id`` found here."""

    if TYPE_CHECKING:  # pragma: no cover
        url_masked: str
        _dialect: Any
        _cluster_id: str | None

        def _connection(self, engine: Engine, *, write: bool) -> ContextManager[Connection]: ...

        def _now(self, conn: Connection) -> Any: ...

    def _prepare_schema(self, engine: Engine) -> None:
        attempts = 4
        for attempt in range(1, attempts + 1):
            # Failing to connect is not a race: let it propagate at once.
            with self._connection(engine, write=True) as conn:
                try:
                    with conn.begin():
                        found = self._check_version(conn)
                        if found is not None and found < SCHEMA_VERSION:
                            self._migrate(conn, found)
                        metadata.create_all(conn, checkfirst=True)
                        self._dialect.insert_if_absent(
                            conn,
                            meta_table,
                            [{"key": "schema_version", "value": str(SCHEMA_VERSION)},
                             {"key": "cluster_id", "value": new_token()}],
                            ["key"],
                        )
                        self._insert_leader_row(conn)
                        self._dialect.insert_if_absent(conn, schedule_version_table, [{"id": 1, "version": 0}], ["id"])
                        # A concurrent opener may have stamped first: check again.
                        self._check_version(conn)
                        self._cluster_id = conn.execute(
                            sa.select(meta_table.c.value).where(meta_table.c.key == "cluster_id")
                        ).scalar_one()
                    return
                except sa.exc.DBAPIError as exc:
                    # Another replica created a table between our "exists?"
                    # check and our CREATE; the next round sees it and skips it.
                    if attempt == attempts or exc.connection_invalidated:
                        raise
                    logger.debug("schema creation raced another node (%s); retrying", exc.orig)
            time.sleep(0.1 * attempt + random.random() * 0.1)

    def _check_schema(self, engine: Engine) -> None:
        """The operators' open: learn the cluster id of a current schema, writing nothing.

        :class:`~.errors.StoreNotInitialised` when no beat prepared the database,
        :class:`~.errors.OlderSchema` when an older release did (whatever it recorded besides its
        version: an older release may not have written every row this one reads),
        :class:`~.errors.SchemaVersionError` when a newer one did."""
        with self._connection(engine, write=False) as conn, conn.begin():
            found = self._check_version(conn)
            if found is None:
                raise StoreNotInitialised(self.url_masked)
            if found < SCHEMA_VERSION:
                raise OlderSchema(self.url_masked, found, SCHEMA_VERSION)
            cluster_id = conn.execute(
                sa.select(meta_table.c.value).where(meta_table.c.key == "cluster_id")).scalar_one_or_none()
        if cluster_id is None:  # a current version and no cluster id: a preparation cut short
            raise StoreNotInitialised(self.url_masked)
        self._cluster_id = cluster_id

    def _migrate(self, conn: Connection, found: int) -> None:
        """Bring a store written by an older release up to :data:`SCHEMA_VERSION`, step by step."""
        for version in range(found, SCHEMA_VERSION):
            logger.info("claim store %s: migrating the schema from version %d to %d",
                        self.url_masked, version, version + 1)
            for step in MIGRATIONS.get(version, ()):
                step(conn)
        conn.execute(
            sa.update(meta_table).where(meta_table.c.key == "schema_version").values(value=str(SCHEMA_VERSION))
        )

    def _check_version(self, conn: Connection) -> int | None:
        """The schema version the database records (None for a new database); refuses a newer one."""
        if not sa.inspect(conn).has_table(meta_table.name):
            return None
        raw = conn.execute(
            sa.select(meta_table.c.value).where(meta_table.c.key == "schema_version")
        ).scalar_one_or_none()
        if raw is None:
            return None
        try:
            version = int(raw)
        except ValueError:
            raise SchemaVersionError(
                f"the claim database {self.url_masked} records schema version {raw!r}, "
                "which this celery-cluster-beat cannot read"
            ) from None
        if version > SCHEMA_VERSION:
            raise SchemaVersionError(
                f"the claim database {self.url_masked} has schema version {version}, newer than "
                f"version {SCHEMA_VERSION} that this celery-cluster-beat understands: it was written "
                "by a newer release. Upgrade celery-cluster-beat on this node (or point it at "
                "another database); refusing to open it"
            )
        return version

    def _insert_leader_row(self, conn: Connection) -> None:
        """Create the leader row (term 0) unless it exists."""
        self._dialect.insert_if_absent(
            conn, leader_table, [{"id": 1, "term": 0, "node": None, "updated_at": self._now(conn)}], ["id"]
        )

