"""What ``cluster-beat check`` checks: the versions, the settings, ``beat_schedule``, the claim store,
Redis, every entry's message (built, never published) and the broker.

Kept apart from the command line (:mod:`.cli`) so that the command declarations stay cheap
to import (Celery imports them in every ``celery`` process) and each check reads as a list.

A claim database no beat has prepared yet passes (``reachable, not initialised yet``): a deploy
runs ``check`` before its first beat starts, and that beat creates the tables. ``check`` itself,
like every operators' command, never creates them.
"""
from __future__ import annotations

from datetime import datetime
from typing import Any, Callable, List, Tuple

from ..errors import ConfigError
from ..leader.urls import mask_url
from ..store.errors import OlderSchema, StoreNotInitialised
from . import report

#: Seconds ``check`` waits for the broker.
BROKER_TIMEOUT = 5.0
#: What ``check`` says of a claim database no beat has prepared yet (no problem: see the docstring).
NOT_INITIALISED_NOTE = "not initialised yet: the first beat creates the tables"


def run_checks(app: Any, problem_lines: Callable[[BaseException], List[str]]) -> List[Tuple[str, bool, str]]:
    """(what, ok, detail) per check; a check with several problems gives one failed line each
    (*problem_lines*: the command line's own way of putting an error in lines)."""
    out: List[Tuple[str, bool, str]] = []

    def problems(what: str, exc: BaseException) -> None:
        out.extend((what, False, line) for line in problem_lines(exc))

    from ..messages import support

    outside = support.outside_tested_range()
    out.extend([("versions", False, line) for line in outside] or [("versions", True, support.describe())])
    settings = None
    try:
        settings = report.load_settings_of(app)
        out.append(("settings", True, f"cluster {settings.cluster_name!r}"))
    except Exception as exc:
        problems("settings", exc)
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
    if settings is not None:
        try:
            store = report.open_store(app, settings)
            try:
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
        if settings.redis is not None:
            try:
                client = settings.redis.client()
                try:
                    client.ping()
                finally:
                    client.close()
                out.append(("redis", True, mask_url(settings.redis.url)))
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
