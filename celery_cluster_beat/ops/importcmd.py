"""``celery -A proj cluster-beat import django-celery-beat|redbeat``: switch in one command.

Reads the other scheduler's store directly (django-celery-beat's tables with SQLAlchemy, RedBeat's
Redis hashes: neither package is needed) and stores what it finds as stored schedules through
:class:`~celery_cluster_beat.dynamic.StoredSchedules`, so every stored-schedule check applies
(:mod:`.importers`). Prints one line per schedule: what it was, what it becomes or why it
cannot be carried over. ``--dry-run`` writes nothing; re-running is idempotent (``unchanged``),
a changed definition is reported (``differs``) and replaced only with ``--update``.

Exit status: 0 when every schedule was carried over (or had nothing to carry: ``skipped``), 1 when
one was refused or left different (the others are imported all the same), or on bad input (one
line on stderr, passwords masked); 3 when the claim database was never prepared by a beat (as
every ``cluster-beat`` command: nothing is created there). Kept out of :mod:`.cli` (which adds
it to its group) and light to import: the readers load when the command runs.
"""
from __future__ import annotations

import json
from typing import Any, Callable, List

import click
from celery.bin.base import CeleryCommand, CeleryOption

from ..leader.urls import mask_url
from .clierrors import boundary, for_terminal

__all__ = ["import_group"]


@click.group(name="import")
def import_group() -> None:
    """Carry schedules over from django-celery-beat or RedBeat as stored schedules."""


def _common(fun: Callable[..., Any]) -> Callable[..., Any]:
    fun = click.option("--json", "as_json", cls=CeleryOption, is_flag=True, default=False,
                       help_group="Output Options", help="Print JSON instead of lines.")(fun)
    fun = click.option("--update", cls=CeleryOption, is_flag=True, default=False, help_group="Import Options",
                       help="Replace stored schedules of the same name whose definition differs "
                            "(default: report them and leave them).")(fun)
    fun = click.option("--dry-run", "dry_run", cls=CeleryOption, is_flag=True, default=False,
                       help_group="Import Options",
                       help="Only say what would be created, updated, left or refused, and why.")(fun)
    return fun


@import_group.command(name="django-celery-beat", cls=CeleryCommand)
@click.option("--db", "db", cls=CeleryOption, required=True, help_group="Import Options",
              help="django-celery-beat's database (SQLAlchemy URL: postgresql://..., mysql://..., sqlite:////path).")
@_common
@click.pass_context
@boundary
def django_celery_beat(ctx: click.Context, db: str, dry_run: bool, update: bool, as_json: bool) -> None:
    """Import django-celery-beat's periodic tasks (read from its tables; Django is not needed)."""
    from .importers import djangobeat

    _run(ctx, "django-celery-beat", mask_url(db), lambda: djangobeat.read(db), dry_run, update, as_json)


@import_group.command(name="redbeat", cls=CeleryCommand)
@click.option("--redis", "redis_url", cls=CeleryOption, required=True, help_group="Import Options",
              help="RedBeat's Redis (redbeat_redis_url).")
@click.option("--key-prefix", "prefix", cls=CeleryOption, default="redbeat:", show_default=True,
              help_group="Import Options", help="RedBeat's redbeat_key_prefix, as is.")
@_common
@click.pass_context
@boundary
def redbeat(ctx: click.Context, redis_url: str, prefix: str, dry_run: bool, update: bool, as_json: bool) -> None:
    """Import RedBeat's entries (read from its Redis keys; RedBeat is not needed)."""
    from .importers import redbeat as reader

    _run(ctx, "RedBeat", f"{mask_url(redis_url)} prefix {prefix!r}", lambda: reader.read(redis_url, prefix),
         dry_run, update, as_json)


def _run(ctx: click.Context, source: str, where: str, read: Callable[[], List[Any]], dry_run: bool,
         update: bool, as_json: bool) -> None:
    from . import report
    from .importers import apply

    app = ctx.obj.app
    report.open_store(app, report.load_settings_of(app)).close()  # prepared by a beat? (else exit 3)
    planned = read()
    outcomes = apply.run(app, planned, dry_run=dry_run, update=update)
    counted = apply.counts(outcomes)
    if as_json:
        click.echo(json.dumps({"source": source, "from": where, "dry_run": dry_run, "counts": counted,
                               "schedules": [o.as_dict() for o in outcomes]}, indent=2))
    else:
        for line in apply.render(outcomes, for_terminal):
            click.echo(line)
        summary = ", ".join(f"{n} {status}" for status, n in counted.items()) or "no schedules"
        tail = " (dry run: nothing written)" if dry_run else ""
        click.echo(f"{source} at {for_terminal(where)}: {summary}{tail}")
    if apply.failed(outcomes):
        raise click.exceptions.Exit(1)
