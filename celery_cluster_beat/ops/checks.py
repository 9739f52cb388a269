"""What ``cluster-beat check`` checks: the versions, the settings, ``beat_schedule``, the claim store,
Redis, every entry's message (built, never published) and the broker.

Kept apart from the command line (:mod:`.cli`) so that the command declarations stay cheap
to import (Celery imports them in every ``celery`` process) and each check reads as a list.

``check`` writes nothing, anywhere: the claim store is opened read-only (no table, file or row is
created or migrated), Redis is only read. A claim store that does not exist yet is no problem, the
same on every dialect: a SQLite file not created yet (its folder exists and is writable), or a
server database without our tables, is reported ``not initialised yet: the first beat creates the
tables`` (a deploy runs ``check`` before its first beat starts, and that beat creates them). An
unreachable server, or a SQLite folder beat could not create the file in, is a problem.

Also problems: a ``cluster_beat_*`` key of the config that no release reads (a misspelt name, which
would otherwise be ignored silently, with the closest known name), a lease whose Redis key names
another claim store (beat would refuse to start; after a rebuilt store, ``adopt-store``), and a
Celery or kombu older than the package supports. A version newer or older than CI tests, but
supported, is an ``ok`` line that starts with ``warning:``.
"""
from __future__ import annotations

import os
from datetime import datetime
from typing import Any, Callable, List, Optional, Tuple

from ..errors import ConfigError
from ..leader.urls import mask_url
from ..store.errors import OlderSchema, StoreNotInitialised
from . import report

#: Seconds ``check`` waits for the broker.
BROKER_TIMEOUT = 5.0
#: What ``check`` says of a claim database no beat has prepared yet (no problem: see the docstring).
NOT_INITIALISED_NOTE = "not initialised yet: the first beat creates the tables"
#: The oldest minor of each package this one supports (setup.cfg: ``celery>=5.3``; Celery 5.3 needs kombu 5.3).
SUPPORTED_MINIMUM = {"celery": (5, 3), "kombu": (5, 3)}


def _dotted(version: Tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def version_checks() -> List[Tuple[str, bool, str]]:
    """Celery and kombu against the tested range (README: Support): inside it, one ok line; newer or
    older but supported, an ok line starting ``warning:`` (the fast path checks itself and falls
    back, but nobody has watched that Celery send); older than supported, a problem."""
    from ..messages import support

    out: List[Tuple[str, bool, str]] = []
    for package, version in support.installed():
        low, high = support.TESTED[package]
        have = support.minor(version)
        tested = f"the tested range {_dotted(low)}-{_dotted(high)}"
        if have < SUPPORTED_MINIMUM[package]:
            out.append(("versions", False, f"{package} {version} is older than {_dotted(SUPPORTED_MINIMUM[package])}, "
                                           f"the oldest this celery-cluster-beat supports ({tested})"))
        elif have < low or have > high:
            out.append(("versions", True, f"warning: {package} {version} is {'newer' if have > high else 'older'} "
                                          f"than {tested}: supported, but no CI run has watched it send"))
    return out or [("versions", True, support.describe())]


def _missing_claim_file(db_url: str) -> Optional[Tuple[bool, str]]:
    """For a SQLite claim file that does not exist yet: (whether beat can create it, what to say);
    None for other databases and for a file that exists."""
    from sqlalchemy.engine import make_url

    from ..store.dialects.sqlite import claim_file

    try:
        url = make_url(db_url)
    except Exception:  # the store reports a bad URL itself
        return None
    if url.get_backend_name() != "sqlite":
        return None
    path = claim_file(url)
    if path is None or os.path.exists(path):
        return None
    folder = os.path.dirname(path)
    if not os.path.isdir(folder):
        return False, (f"{mask_url(db_url)}: the folder {folder} does not exist, and beat does not create "
                       "folders; create it (writable by beat's user) or set cluster_beat_db_url")
    if not os.access(folder, os.W_OK | os.X_OK):
        return False, (f"{mask_url(db_url)}: the folder {folder} is not writable by this user (uid "
                       f"{os.getuid()}), so the claim file cannot be created there")
    return True, f"{mask_url(db_url)} not created yet (its folder is writable), {NOT_INITIALISED_NOTE}"


def run_checks(app: Any, problem_lines: Callable[[BaseException], List[str]]) -> List[Tuple[str, bool, str]]:
    """(what, ok, detail) per check; a check with several problems gives one failed line each
    (*problem_lines*: the command line's own way of putting an error in lines)."""
    out: List[Tuple[str, bool, str]] = []

    def problems(what: str, exc: BaseException) -> None:
        out.extend((what, False, line) for line in problem_lines(exc))

    out.extend(version_checks())
    settings = None
    try:
        settings = report.load_settings_of(app)
    except Exception as exc:
        problems("settings", exc)
    from ..config.settings import unknown_settings

    ignored = unknown_settings(app.conf)
    out.extend(("settings", False, line) for line in ignored)
    if settings is not None and not ignored:
        out.append(("settings", True, f"cluster {settings.cluster_name!r}"))
    entries = None
    stored: list = []  # stored schedules whose messages are built too (read with the claim store)
    try:
        entries = report.config_entries(app)
        if settings is not None:
            from ..config.observing import configuration_problems

            found = configuration_problems(app, settings, entries.values())
            if found:
                raise ConfigError(found)
        out.append(("beat_schedule", True, f"{len(entries)} entr{'y' if len(entries) == 1 else 'ies'}"))
    except Exception as exc:
        problems("beat_schedule", exc)
    cluster_id = None  # the claim store's, once read
    missing = _missing_claim_file(settings.db_url) if settings is not None else None
    if missing is not None:
        out.append(("claim store", *missing))
    elif settings is not None:
        try:
            store = report.open_store(app, settings)
            try:
                cluster_id = store.cluster_id
                if entries:
                    store.check_names(entries)
                    clash = store.stored_get(sorted(entries))
                    if clash:
                        raise ConfigError([f"beat_schedule entry {r.name!r} and the stored schedule {r.name!r} "
                                           "share a name" for r in clash])
                version = store.overview(grace=settings.claim_grace, unsent_limit=1).schema_version
                out.append(("claim store", True, f"{mask_url(settings.db_url)} (schema {version})"))
                stored = store.stored_list(limit=MAX_STORED_CHECKED + 1)
            finally:
                store.close()
        except StoreNotInitialised:
            out.append(("claim store", True, f"{mask_url(settings.db_url)} reachable, {NOT_INITIALISED_NOTE}"))
        except OlderSchema as exc:  # a deploy checks before its beats migrate: not a problem of the deploy
            out.append(("claim store", True, f"{mask_url(settings.db_url)} reachable, schema {exc.found}: the "
                        f"first beat of this release migrates it to {exc.current}"))
        except Exception as exc:
            problems("claim store", exc)
    if settings is not None:
        if settings.redis is not None:
            try:
                client = settings.redis.client()
                try:
                    client.ping()
                    out.append(_lease_check(client, settings, cluster_id))
                finally:
                    client.close()
            except Exception as exc:
                problems("redis", exc)
        else:
            out.append(("redis", True, "no lease configured (replicas race on claims)"))
    if entries is not None and settings is not None:
        out.extend(_message_checks(app, settings, entries, stored))
    try:
        conn = app.connection_for_write()
        try:
            conn.ensure_connection(max_retries=1, interval_start=0, interval_step=0.5, interval_max=0.5,
                                   timeout=BROKER_TIMEOUT)
            out.append(("broker", True, mask_url(conn.as_uri(include_password=True))))
        finally:
            conn.release()
    except Exception as exc:
        problems("broker", exc)
    return out


def _lease_check(client: Any, settings: Any, cluster_id: Optional[str]) -> Tuple[str, bool, str]:
    """The lease's Redis answers; and, the claim store's id known, its cluster id key does not name
    another store (beat would refuse to start: say so now, with the way back after a rebuilt store)."""
    from ..leader.identity import ClusterIdentity, cluster_key
    from ..leader.scripts import text

    where = mask_url(settings.redis.url)
    theirs = client.get(cluster_key(settings.cluster_name)) if cluster_id else None
    if theirs is None or text(theirs) == cluster_id:
        return "redis", True, where
    identity = ClusterIdentity(name=settings.cluster_name, node_id=settings.node_id, cluster_id=cluster_id,
                               redis_url=settings.redis.url)
    return "redis", False, f"beat would refuse to start: {identity.message(text(theirs))}"


#: ``check`` builds the messages of at most this many stored schedules (the rest are said to be unchecked).
MAX_STORED_CHECKED = 1000


def _message_checks(app: Any, settings: Any, entries: dict, stored: list) -> List[Tuple[str, bool, str]]:
    """Build (never publish) each entry's message: one problem line per entry that cannot be
    sent at all; one line saying how many take the fast path and why the others do not."""
    from datetime import timezone

    from ..dynamic.convert import entry_from_row
    from ..messages import Templates
    from ..messages.dryrun import SendPath, dry_run
    from ..worker.protocol import beat_headers

    out: List[Tuple[str, bool, str]] = []
    todo = list(entries.values())
    unchecked = max(0, len(stored) - MAX_STORED_CHECKED)
    for row in stored[:MAX_STORED_CHECKED]:
        try:
            todo.append(entry_from_row(row, app))
        except Exception as exc:
            out.append(("messages", False, f"stored schedule {row.name!r}: cannot be read: {exc}"[:600]))
    templates = Templates(app)
    at = datetime.now(timezone.utc).replace(microsecond=0)
    paths = {path: 0 for path in SendPath}
    why: dict = {}
    for entry in todo:
        headers = dict(entry.options.get("headers") or {})
        headers.update(beat_headers(entry.name, at, settings.node_id))
        result = dry_run(app, templates, entry.name, entry.task, entry.args, entry.kwargs, entry.options, headers)
        paths[result.path] += 1
        if result.path is SendPath.UNSENDABLE:
            out.append(("messages", False, f"entry {entry.name!r} (task {entry.task}) cannot be sent: {result.detail}"))
        elif result.path is SendPath.CELERY:
            why.setdefault(result.detail, entry.name)
    summary = (f"{paths[SendPath.TEMPLATE]} entr{'y' if paths[SendPath.TEMPLATE] == 1 else 'ies'} prebuilt, "
               f"{paths[SendPath.CELERY]} through Celery's own path")
    if why:
        summary += " (" + "; ".join(f"{name} and others like it: {reason}" for reason, name in why.items()) + ")"
    if unchecked:
        summary += f"; {unchecked} stored schedule(s) beyond the first {MAX_STORED_CHECKED} not built"
    out.append(("messages", True, summary))
    return out
