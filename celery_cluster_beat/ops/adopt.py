"""``celery -A proj cluster-beat adopt-store``: the way back after the claim database was rebuilt.

Every claim store has a random cluster id, and the lease's Redis records the id of the store its
holders write to (``cluster_beat:{<name>}:cluster``, :mod:`celery_cluster_beat.leader.identity`),
so that two stores are never sent from under one lease: each would keep a history of its own and
resend what the other sent. A claim database rebuilt from scratch (restored empty, recreated,
moved to a new server) gets a new id, and for up to 30 days every beat of the cluster refuses to
start, naming this command. It moves the lease's cluster id to the current store:

* it reads the current store's id (read-only: nothing is written there; a store no beat prepared
  is ``not initialised yet``, exit 3, as for every operators' command);
* it refuses while anybody holds the lease (exit 1): a holder renews its key, so it is alive, and
  it serves the old store; stop the beats still running on the old store first (a holder that
  died lets its key expire within ``cluster_beat_lock_ttl``);
* it says what it will do and asks (``--yes`` skips the question, ``--dry-run`` only says);
* the change is one Lua script that writes only while the lease is still free and the key still
  names the store the operator was shown (a compare-and-set): a beat of the old store that takes
  the lease meanwhile, or another operator, makes it refuse instead. Afterwards a beat of the old
  store is refused like any node of another store, so the two are never sent from together.

Kept out of :mod:`.cli` (which only adds this command to its group) and light to import: Celery
imports the command declarations in every ``celery`` process; the settings, the store and
redis-py load when the command runs.
"""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Optional

import click
from celery.bin.base import CeleryCommand, CeleryOption

from ..errors import ConfigError
from ..leader.urls import mask_url
from .clierrors import NOT_INITIALISED, boundary

__all__ = ["adopt_store", "NOT_INITIALISED"]

def _current_store_id(app: Any, settings: Any) -> str:
    """The id of the claim store *app* is configured with, read without writing anything."""
    from sqlalchemy.engine import make_url

    from ..store.dialects.sqlite import claim_file
    from ..store.errors import StoreNotInitialised
    from . import report

    try:
        url = make_url(settings.db_url)
        path = claim_file(url) if url.get_backend_name() == "sqlite" else None
    except Exception:  # the store says what is wrong with the URL
        path = None
    if path is not None and not os.path.exists(path):  # opening it read-only would not create it, but say so
        raise StoreNotInitialised(path, "no claim database file at")
    store = report.open_store(app, settings)
    try:
        return store.cluster_id
    finally:
        store.close()


def _standbys(client: Any, channel: str) -> Optional[int]:
    """How many beats listen on the lease's release channel (standbys), if Redis says."""
    try:
        reply = client.pubsub_numsub(channel)
        return int(reply[0][1]) if reply else 0
    except Exception:  # a Redis Cluster (sharded channels), or a server that does not say
        return None


@click.command(name="adopt-store", cls=CeleryCommand)
@click.option("--yes", "-y", "yes", cls=CeleryOption, is_flag=True, default=False, help_group="Adopt Options",
              help="Do not ask before changing the lease's claim store.")
@click.option("--dry-run", "dry_run", cls=CeleryOption, is_flag=True, default=False, help_group="Adopt Options",
              help="Say what would be done; change nothing.")
@click.option("--json", "as_json", cls=CeleryOption, is_flag=True, default=False, help_group="Output Options",
              help="Print JSON instead of text (the question, if asked, goes to stderr).")
@click.pass_context
@boundary
def adopt_store(ctx: click.Context, yes: bool, dry_run: bool, as_json: bool) -> None:
    """Make the lease serve this claim store after the claim database was rebuilt.

    Refuses while a beat holds the lease (the old store is live): stop the beats still running
    on the old store first. Atomic: changes the lease's record only from the store shown."""
    from ..leader.identity import AdoptStatus, adopt, cluster_key
    from ..leader.scripts import lease_keys, parse_value, text
    from . import report

    app = ctx.obj.app
    settings = report.load_settings_of(app)
    if settings.redis is None:
        raise ConfigError("no lease is configured (cluster_beat_redis_url is ''): no Redis records a claim store, "
                          "so there is nothing to adopt")
    ours = _current_store_id(app, settings)
    name, key = settings.cluster_name, cluster_key(settings.cluster_name)
    lease_key, _, channel = lease_keys(name)
    where = mask_url(settings.redis.url)
    client = settings.redis.client()
    try:
        raw = client.get(key)
        recorded = None if raw is None else text(raw)
        held, pttl = client.get(lease_key), client.pttl(lease_key)
        standbys = _standbys(client, channel) if recorded not in (None, ours) else None
        doc: Dict[str, Any] = {"cluster": name, "redis": where, "key": key, "recorded": recorded, "store": ours,
                               "store_url": mask_url(settings.db_url), "holder": None, "adopted": False,
                               "dry_run": dry_run}
        say = (lambda line: None) if as_json else (lambda line: click.echo(line))
        if held is not None:
            term, node = parse_value(held)
            doc["holder"] = {"node": node, "term": term, "expires_in": max(0, pttl) / 1000}
        say(f"lease          {name!r}: Redis key {key} on {where}")
        say(f"it serves      claim store {recorded or '- (none recorded)'}")
        say(f"this store     {ours} ({mask_url(settings.db_url)})")
        if recorded is None or recorded == ours:
            why = ("it serves this claim store already" if recorded == ours else
                   "no claim store is recorded: the first beat that takes the lease records this one")
            say(f"nothing to do: {why}")
            _done(doc, as_json)
            return
        if held is not None:
            holder = doc["holder"]
            raise ConfigError(
                f"refused: node {holder['node'] or '?'} holds the lease {name!r} (term {holder['term']}; its key "
                f"expires in {holder['expires_in']:.1f}s unless renewed): a beat of claim store {recorded} is "
                "running. Stop every beat still running on the old claim database (or restart it on this one: it "
                "then refuses to start), then run adopt-store again")
        if standbys:
            say(f"note           {standbys} beat(s) listen on the lease's release channel without holding it: "
                f"beats of claim store {recorded} that cannot reach it; from now on they are refused the lease")
        if dry_run:
            say(f"dry run        would make the lease {name!r} serve claim store {ours} (nothing changed)")
            _done(doc, as_json)
            return
        if not yes:
            click.confirm(f"Make the lease {name!r} serve claim store {ours}? Beats of claim store {recorded} "
                          "are refused from then on", abort=True, err=True)
        reply = adopt(client, name, expected=recorded, new=ours)
    finally:
        client.close()
    if reply.status is AdoptStatus.HELD:
        term, node = parse_value(reply.value)
        raise ConfigError(f"refused: node {node or '?'} took the lease {name!r} meanwhile (term {term}): a beat of "
                          f"claim store {recorded} is running; stop it, then run adopt-store again")
    if reply.status is AdoptStatus.CHANGED:
        raise ConfigError(f"refused: the lease {name!r} serves claim store {reply.value or '- (none)'} now, not "
                          f"{recorded} as read a moment ago; nothing changed, run adopt-store again to see why")
    doc["adopted"] = True
    if not as_json:
        click.echo(f"adopted        the lease {name!r} serves claim store {ours} now (was {recorded}); start the beats")
    _done(doc, as_json)


def _done(doc: Dict[str, Any], as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(doc, indent=2))
