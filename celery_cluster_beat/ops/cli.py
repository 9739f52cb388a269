"""``celery -A proj cluster-beat ...``: operate a cluster from Celery's own command line.

Registered through Celery's ``celery.commands`` entry point, so it sits beside
``beat`` and ``worker``. Reads come from the claim store (and the lease's Redis
for ``status``): no beat has to run. Actions (``pause``, ``resume``,
``run-now``, ``backfill``) are rows in the claim store plus a change notice on Redis; the
leader applies them within a second, and they survive restarts and failovers.

Bad input (an unknown schedule, a bad duration, an unreachable database) is one
line on stderr and exit code 1, never a traceback.

Reads (``status``, ``list``, ``history``, ``check``) open the claim store read-only: they work
with a SELECT-only database role and never create, migrate or write anything. No command creates
or migrates the schema, actions (``pause``, ``resume``, ``run-now``, ``prune``) included: they
write rows only into tables a beat prepared, so a mistyped or empty database is not given tables
and a cluster id of its own while the command reports success. On a database no beat has
prepared yet every command but ``check`` prints one line (``not initialised yet: ...``) on stderr
and exits with :data:`NOT_INITIALISED` (3); ``check`` reports the store as reachable and not
initialised yet, which is no problem (a deploy runs ``check`` before the first beat starts). An
older schema is named, not migrated (exit 1): beat migrates it.

Stored text (names, tasks, descriptions, owners, node and host names, reasons and errors) is
printed through :func:`~celery_cluster_beat.config.values.printable`: control and format
characters come out as escapes (``\\x1b``, ``\\n``, ``\\u202e``), so a row written past the API
cannot clear the operator's screen or draw a fake row. ``--json`` output is escaped by JSON itself.

The tables themselves are :mod:`.cliviews`'s (loaded by the command that prints one): ``list`` fits
120 columns (the rule in words with its zone, next fire and last outcome relative to the database's
clock, the overlap policy) and ``--wide`` prints every column uncut; ``pause NAME --note TEXT`` keeps
why, and ``list``, ``status`` and ``history`` show who paused, when and why.
"""
from __future__ import annotations

import getpass
import importlib
import json
import re
import socket
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, Callable, Optional, Tuple

import click
from celery.bin.base import CeleryCommand, CeleryOption, handle_preload_options

from .clierrors import NOT_INITIALISED, boundary, for_terminal, problems as _problems  # noqa: F401  (NOT_INITIALISED: importable from here as before)


class _ImportOnUse:
    """Stands for a module and imports it when one of its attributes is first read.

    Celery imports every ``celery.commands`` plugin whenever any ``celery`` command starts
    (each worker, beat, ``inspect``), so this module declares its commands with click alone;
    the report, and with it SQLAlchemy, the store and the stored-schedule API, loads in the
    command that reads it. ``tests/ops/test_plugin_import.py`` holds that bound: import
    anything heavy here at module level and it fails."""

    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        return getattr(importlib.import_module(self._name), attr)

    def __repr__(self) -> str:
        return f"<{self._name}, imported on first use>"


if TYPE_CHECKING:
    from . import backfill as backfills
    from . import cliviews as views
    from . import report
else:
    backfills = _ImportOnUse(f"{__package__}.backfill")  # the backfill command's plan, request and wait
    report = _ImportOnUse(f"{__package__}.report")
    views = _ImportOnUse(f"{__package__}.cliviews")  # the tables: loaded by a command that prints one


def __getattr__(name: str) -> Any:
    """``render_status``, ``render_list``, ``render_history`` and ``table``, importable from here as
    before; they live in :mod:`.cliviews`, loaded on first use."""
    if name in ("render_status", "render_list", "render_history", "table"):
        return getattr(views, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_UNITS = {"w": 7 * 86400, "d": 86400, "h": 3600, "m": 60, "s": 1}
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([wdhms])")


def parse_duration(text: str) -> float:
    """Seconds of ``7d``, ``12h``, ``90m``, ``30s``, ``1h30m``, ``2w`` or plain seconds (``3600``)."""
    value = (text or "").strip().lower()
    try:
        seconds = float(value)
    except ValueError:
        parts = _DURATION.findall(value)
        if not parts or "".join(n + u for n, u in parts) != value:
            raise ValueError(f"bad duration {text!r}: expected e.g. 7d, 12h, 90m, 30s or 1h30m") from None
        seconds = sum(float(n) * _UNITS[u] for n, u in parts)
    if not seconds > 0 or seconds == float("inf"):
        raise ValueError(f"bad duration {text!r}: must be more than 0")
    return seconds


# ----------------------------------------------------------------------------- output


def _when(value: Optional[datetime]) -> str:
    return "-" if value is None else value.strftime("%Y-%m-%d %H:%M:%S")


def _json_out(value: Any) -> None:
    click.echo(json.dumps(value, indent=2, sort_keys=False))


def _operator() -> str:
    try:
        user = getpass.getuser()
    except Exception:  # no user name (a container without passwd entry)
        user = "?"
    return f"{user}@{socket.gethostname()}"


json_option = click.option("--json", "as_json", cls=CeleryOption, is_flag=True, default=False,
                           help_group="Output Options", help="Print JSON instead of a table.")


# ----------------------------------------------------------------------------- the group


@click.group(name="cluster-beat")
@click.pass_context
@handle_preload_options
def cluster_beat(ctx: click.Context, **kwargs: Any) -> None:
    """Operate celery-cluster-beat: status, schedules, history, pause / resume / run-now, backfill, prune, check, import.

    Reads need no running beat; actions are applied by the leader within a second."""


def _app(ctx: click.Context) -> Any:
    return ctx.obj.app


# ----------------------------------------------------------------------------- reads


@cluster_beat.command(cls=CeleryCommand)
@json_option
@click.pass_context
@boundary
def status(ctx: click.Context, as_json: bool) -> None:
    """Leader, term and lease, nodes, claim store, schedules, occurrences late right now."""
    st = report.cluster_status(_app(ctx))
    if as_json:
        _json_out(st.as_dict())
        return
    click.echo(views.render_status(st))


@cluster_beat.command(name="list", cls=CeleryCommand)
@click.option("--wide", cls=CeleryOption, is_flag=True, default=False, help_group="List Options",
              help="Every column, uncut: exact rule text, task, counters, UTC times (default: fit 120 columns).")
@json_option
@click.pass_context
@boundary
def list_(ctx: click.Context, wide: bool, as_json: bool) -> None:
    """Every schedule: rule in words and zone, next fire, last outcome, overlap policy, state, source."""
    app = _app(ctx)
    with report.Opened(app, None) as store:
        now = store.db_now()
        schedules = report.schedule_list(app, store=store)
    if as_json:
        _json_out([s.as_dict() for s in schedules])
        return
    click.echo(views.render_list(schedules, now, wide=wide))


@cluster_beat.command(cls=CeleryCommand)
@click.argument("name")
@click.option("--limit", cls=CeleryOption, type=int, default=50, show_default=True, help_group="History Options",
              help="How many of the latest occurrences.")
@json_option
@click.pass_context
@boundary
def history(ctx: click.Context, name: str, limit: int, as_json: bool) -> None:
    """Recent occurrences of schedule NAME: instant, status, node, sent / started / finished, runtime, error."""
    app = _app(ctx)
    with report.Opened(app, None) as store:
        rows = report.history(app, name, limit=limit, store=store)
        paused = None if as_json else report.paused_info(store, name)
        now = None if paused is None else store.db_now()
    if as_json:
        _json_out([r.as_dict() for r in rows])
        return
    if paused is not None:
        click.echo(views.pause_line(name, paused, now))
    if not rows:
        click.echo(f"no occurrence of {name!r} is recorded (yet, or any more: pruned)")
        return
    click.echo(views.render_history(rows))


@cluster_beat.command(cls=CeleryCommand)
@json_option
@click.pass_context
@boundary
def check(ctx: click.Context, as_json: bool) -> None:
    """Validate the configuration and reach the claim store, Redis and the broker.

    Prints one line per check; exits 1 if any failed (one line per problem on stderr)."""
    from .checks import run_checks

    results = run_checks(_app(ctx), _problems)
    failed = [r for r in results if not r[1]]
    if as_json:
        _json_out({"ok": not failed, "checks": [{"check": name, "ok": ok, "detail": detail}
                                               for name, ok, detail in results]})
    else:
        for name, ok, detail in results:
            if ok:
                click.echo(f"ok       {name}: {for_terminal(detail)}")
            else:
                click.echo(f"problem  {name}: {for_terminal(detail)}", err=True)
    if failed:
        raise click.exceptions.Exit(1)


# ----------------------------------------------------------------------------- actions


def _act(app: Any, name: str, action: Callable[[Any], Any], *, paused_ok: bool = False) -> Tuple[Any, str]:
    """Run *action(store)* on a known schedule, then tell the leader (:func:`.report.act_on_schedule`,
    the dashboard's actions' path too)."""
    return report.act_on_schedule(app, report.load_settings_of(app), name, action, paused_ok=paused_ok)


@cluster_beat.command(cls=CeleryCommand)
@click.argument("name")
@click.option("--note", cls=CeleryOption, default=None, help_group="Pause Options",
              help="Why (shown by list, status and history; up to 500 characters).")
@json_option
@click.pass_context
@boundary
def pause(ctx: click.Context, name: str, note: Optional[str], as_json: bool) -> None:
    """Pause schedule NAME (config or stored): nothing is sent or recorded until resumed."""
    _pause(ctx, name, True, as_json, note=note)


@cluster_beat.command(cls=CeleryCommand)
@click.argument("name")
@json_option
@click.pass_context
@boundary
def resume(ctx: click.Context, name: str, as_json: bool) -> None:
    """Resume schedule NAME: it fires again from now on, without catching up the pause."""
    _pause(ctx, name, False, as_json)


def _pause(ctx: click.Context, name: str, paused: bool, as_json: bool, note: Optional[str] = None) -> None:
    by = _operator()
    if note is not None:
        from ..store.controls import pause_note

        note = pause_note(note)  # refused (one line, exit 1) before anything is written
    (version, changed), source = _act(_app(ctx), name,
                                      lambda store: store.set_paused(name, paused, by=by, note=note),
                                      paused_ok=not paused)
    word = "paused" if paused else "resumed"
    if as_json:
        _json_out({"schedule": name, "source": source, "paused": paused, "changed": changed, "version": version,
                   "note": note})
    elif changed:
        click.echo(f"{word} {name!r} ({source}); the leader applies it within 1 s")
    elif note is not None:
        click.echo(f"{name!r} was paused already; its note is now: {for_terminal(note)}")
    else:
        click.echo(f"{name!r} was {'paused' if paused else 'not paused'} already")


@cluster_beat.command(name="run-now", cls=CeleryCommand)
@click.argument("name")
@json_option
@click.pass_context
@boundary
def run_now(ctx: click.Context, name: str, as_json: bool) -> None:
    """Send one extra occurrence of NAME now (reported as manual); presses while one is pending join it."""
    by = _operator()
    (version, request, at, joined), source = _act(_app(ctx), name, lambda store: store.request_run(name, by=by))
    if as_json:
        _json_out({"schedule": name, "source": source, "request": request, "scheduled_at": at.isoformat(),
                   "joined": joined, "version": version})
    elif joined:
        click.echo(f"a run of {name!r} is pending already (request {request}, instant {at.isoformat()}): "
                   "joined it, one run")
    else:
        click.echo(f"run of {name!r} requested (request {request}, instant {at.isoformat()}); "
                   "the leader sends it within 1 s")


#: ``backfill --limit``'s default and cap (store.backfill's DEFAULT_LIMIT and MAX_LIMIT, which this
#: module may not import: it loads with every celery command).
BACKFILL_LIMIT, BACKFILL_MAX = 1000, 10000


@cluster_beat.command(cls=CeleryCommand)
@click.argument("name")
@click.option("--from", "start", cls=CeleryOption, required=True, help_group="Backfill Options",
              help="First instant of the range (ISO 8601; no offset: UTC).")
@click.option("--to", "end", cls=CeleryOption, required=True, help_group="Backfill Options",
              help="Last instant of the range (inclusive; not after the claim database's clock).")
@click.option("--limit", cls=CeleryOption, type=int, default=BACKFILL_LIMIT, show_default=True,
              help_group="Backfill Options",
              help=f"Most occurrences the range may hold (at most {BACKFILL_MAX}); a range with more is refused.")
@click.option("--dry-run", "dry_run", cls=CeleryOption, is_flag=True, default=False, help_group="Backfill Options",
              help="List what would be sent and what would not, and why; write nothing.")
@click.option("--no-wait", "no_wait", cls=CeleryOption, is_flag=True, default=False, help_group="Backfill Options",
              help="Record the request and return at once (the leader serves it).")
@click.option("--timeout", cls=CeleryOption, type=float, default=60.0, show_default=True,
              help_group="Backfill Options", help="Seconds to wait for the leader's result.")
@json_option
@click.pass_context
@boundary
def backfill(ctx: click.Context, name: str, start: str, end: str, limit: int, dry_run: bool, no_wait: bool,
             timeout: float, as_json: bool) -> None:
    """Send NAME's past occurrences from --from to --to that were never sent (no row, or missed,
    skipped or failed without a run), once each, marked as backfill; sent ones are not sent again."""
    app = _app(ctx)
    first, last = backfills.parse_instant(start, "--from"), backfills.parse_instant(end, "--to")
    if not 1 <= limit <= BACKFILL_MAX:
        raise ValueError(f"--limit must be from 1 to {BACKFILL_MAX}, got {limit}")
    settings = report.load_settings_of(app)
    if dry_run:
        store = report.open_store(app, settings)
        try:
            planned = backfills.plan(app, store, name, first, last, limit, settings.claim_retention)
        finally:
            store.close()
        if as_json:
            _json_out(planned.as_dict())
            return
        click.echo(views.backfill_plan(planned))
        return
    recorded, planned = backfills.request(app, settings, name, first, last, limit, _operator())
    found = recorded if no_wait else backfills.wait(app, settings, recorded.id, timeout)
    if as_json:
        _json_out(backfills.result_dict(found))
        return
    click.echo(views.backfill_result(found, len(planned.items)))


@cluster_beat.command(cls=CeleryCommand)
@click.option("--older-than", "older_than", cls=CeleryOption, default=None, help_group="Prune Options",
              help="Delete claim rows of occurrences older than this (7d, 12h, 90m, 30s); "
                   "default: cluster_beat_claim_retention.")
@json_option
@click.pass_context
@boundary
def prune(ctx: click.Context, older_than: Optional[str], as_json: bool) -> None:
    """Delete finished claim rows older than --older-than (rows still claimed are kept)."""
    app = _app(ctx)
    seconds = parse_duration(older_than) if older_than is not None else None
    settings = report.load_settings_of(app)
    if seconds is None:
        seconds = settings.claim_retention
    store = report.open_store(app, settings, write=True)
    try:
        cutoff = store.db_now() - timedelta(seconds=seconds)
        deleted = store.prune(cutoff)
    finally:
        store.close()
    if as_json:
        _json_out({"deleted": deleted, "older_than": seconds, "cutoff": cutoff.isoformat()})
    else:
        click.echo(f"deleted {deleted} claim row(s) of occurrences before {_when(cutoff)} UTC")


from .adopt import adopt_store  # noqa: E402  (the command after a rebuilt claim store: ops/adopt.py)
cluster_beat.add_command(adopt_store)
from .importcmd import import_group  # noqa: E402  (switching from django-celery-beat or RedBeat: ops/importcmd.py)
cluster_beat.add_command(import_group)
