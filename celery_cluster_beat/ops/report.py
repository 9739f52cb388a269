"""What operators see of a cluster: the data behind ``celery ... cluster-beat status / list / history``
and the status page.

Everything is read from the claim store (and the lease's Redis for ``status``); no beat
process needs to run. Times are the database's clock, aware UTC; ``as_dict()`` gives
JSON-safe values (ISO 8601 times) and never a secret (URLs are masked).

A schedule's next fire is *computed* here from its rule and the database's clock, as the
leader computes it; the message of a schedule with ``jitter`` goes out up to that much later.

API (stable; the status page builds on it):

* :func:`cluster_status` ``(app, store=None, redis=None) -> ClusterStatus``
* :func:`schedule_list` ``(app, store=None) -> List[ScheduleInfo]``
* :func:`history` ``(app, name, limit=50, store=None) -> List[HistoryRow]``
* :func:`load_settings_of` ``(app) -> Settings``, :func:`open_store` ``(app, settings=None, *, write=False)
  -> ClaimStore``: **read-only unless** ``write=True`` (a write on it raises
  :class:`~celery_cluster_beat.store.errors.ReadOnlyStore`, a ``ConfigError``, saying so); either way
  it never creates or migrates the schema (:class:`~celery_cluster_beat.store.errors.StoreNotInitialised`
  on a database no beat prepared, :class:`~celery_cluster_beat.store.errors.OlderSchema` on an older
  one); :class:`Opened` ``(app, store, settings)`` uses a given store or opens one (read-only) for a
  ``with`` block; :func:`schedule_source` ``(app, name, store) -> 'config' | 'stored'``
  (:class:`NoSuchSchedule` otherwise)
* the status page's first schedules by relevance: :func:`.schedulepage.schedule_page`; the records
  all these return: :mod:`.records` (importable from here)
"""
from __future__ import annotations

import dataclasses
import logging
import os
import socket
from datetime import datetime, timedelta
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..config.celeryconf import default_entries, has_result_backend
from ..config.entries import Entry, build_entries
from ..config.observing import ignores_results, uses_ledger
from ..config.values import OverlapPolicy
from ..config.settings import Settings, load_settings
from ..dynamic.convert import entry_from_row
from ..errors import ConfigError, ScheduleError, UnknownSchedule
from ..leader.lease import _parse_value, lease_keys
from ..leader.urls import mask_url
from ..schedules.celery_types import app_zone, cron, every
from ..schedules.tzwall import zone_name
from ..schedules.text import schedule_text
from ..store import SCHEMA_VERSION, ClaimStore
from ..store.stored import StoredRow
from .records import (MANUAL, ClusterStatus, Counters, HistoryRow, LeaseInfo,  # noqa: F401  (the API's records)
                      NodeInfo, NodeStatus, PausedInfo, ScheduleInfo, UnsentOccurrence)
from .words import compact, cron_fields, rule_words

__all__ = ["ClusterStatus", "LeaseInfo", "NodeInfo", "NodeStatus", "PausedInfo", "UnsentOccurrence", "ScheduleInfo",
           "Counters", "HistoryRow",
           "NoSuchSchedule", "cluster_status", "schedule_list", "history", "load_settings_of", "open_store",
           "schedule_source", "act_on_schedule", "config_entries", "Opened", "ScheduleReads", "RECENT_NODES",
           "paused_info", "node_status"]

logger = logging.getLogger("celery_cluster_beat")

#: A node whose last heartbeat is older than this (seconds) is left out of ``status``.
RECENT_NODES = 3600.0
#: At most this many of the unsent occurrences are listed (all are counted).
UNSENT_SHOWN = 20


class NoSuchSchedule(UnknownSchedule):
    """Neither the Celery config nor the stored schedules have this name."""

    def __str__(self) -> str:
        return f"no schedule is named {self.name!r} (neither a beat_schedule entry nor a stored schedule)"


# ----------------------------------------------------------------------------- plumbing


def load_settings_of(app: Any) -> Settings:
    """The app's ``cluster_beat_*`` settings (ConfigError listing every problem)."""
    return load_settings(app.conf, has_result_backend=lambda: has_result_backend(app), app_name=app.main)


def open_store(app: Any, settings: Optional[Settings] = None, *, write: bool = False) -> ClaimStore:
    """An open claim store of *app*'s cluster for operators' reads (or, *write*, controls); close it
    after use.

    Read-only unless *write*: nothing is written, a SELECT-only role is enough, and a write asked
    of it raises :class:`~celery_cluster_beat.store.errors.ReadOnlyStore`. Either way the schema is
    only checked, never created or migrated (beat does that): a database no beat prepared yet is
    ``StoreNotInitialised`` (so a mistyped URL is not given tables of its own), an older schema
    ``OlderSchema``. A server that does not answer fails within 5 s (StoreUnavailable)."""
    settings = settings or load_settings_of(app)
    options: Dict[str, Any] = {}
    if not settings.db_url.startswith("sqlite") and "connect_timeout" not in settings.db_url:
        options["connect_args"] = {"connect_timeout": 5}
    node = f"ops:{socket.gethostname()}:{os.getpid()}"[:255]
    path = _sqlite_path(settings.db_url)
    if path is not None and not os.path.exists(path):
        # Opening would create an empty database that no beat reads, and actions would "succeed".
        raise ConfigError(f"no claim database at {path}: set cluster_beat_db_url (or beat_schedule_filename) "
                          "to the one beat uses, or run this where beat runs")
    store = ClaimStore(settings.db_url, node_id=node, engine_options=options, lock_timeout=2.0,
                        db_timeout=settings.db_timeout, read_only=not write, prepare=False)
    store.open()
    return store


def _sqlite_path(url: str) -> Optional[str]:
    """The file of a SQLite URL (None for other databases and in-memory SQLite)."""
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
    except Exception:  # the store reports a bad URL itself
        return None
    if parsed.get_backend_name() != "sqlite" or not parsed.database or parsed.database == ":memory:":
        return None
    return os.path.abspath(parsed.database)


def config_entries(app: Any) -> Dict[str, Entry]:
    """The app's ``beat_schedule`` entries and Celery's default ones, validated (ConfigError)."""
    entries = build_entries(app.conf.beat_schedule, app=app)
    entries.update(build_entries(default_entries(app, entries), app=app))
    return entries


def _config_names(app: Any) -> List[str]:
    beat_schedule = app.conf.beat_schedule or {}
    names = [n for n in beat_schedule if isinstance(n, str)]
    names += list(default_entries(app, beat_schedule))
    return names


def schedule_source(app: Any, name: str, store: ClaimStore) -> str:
    """``config`` or ``stored``; :class:`NoSuchSchedule` when neither has *name*."""
    if name in _config_names(app):
        return "config"
    if store.stored_get([name]):
        return "stored"
    raise NoSuchSchedule(name)


def act_on_schedule(app: Any, settings: Settings, name: str, action: Callable[[ClaimStore], Any], *,
                    paused_ok: bool = False, quiet_notice: bool = False) -> Tuple[Any, str]:
    """The operators' actions (``pause``, ``resume``, ``run-now``), one code path for the command
    line and the dashboard: *action(store)* on a store opened for writing for it once *name* is
    known (:func:`schedule_source`), then a change notice to the leader (Redis) so it applies within
    a second. *action* returns a tuple whose first item is the change counter's new value.
    (what *action* returned, the schedule's source: ``config``, ``stored`` or ``gone``).

    *paused_ok*: a name no schedule has any more may still be acted on while it is paused (resuming
    a config entry removed while paused, so that re-adding it does not find it paused).
    *quiet_notice*: a failed notice is a debug line, not an error (the leader polls the change
    counter anyway; the dashboard has applied the action already)."""
    store = open_store(app, settings, write=True)
    try:
        try:
            source = schedule_source(app, name, store)
        except NoSuchSchedule:
            if not (paused_ok and any(c.paused for c in store.controls([name]))):
                raise
            source = "gone"
        result = action(store)
    finally:
        store.close()
    if settings.redis is not None:
        from ..leader.notices import ChangeNotices

        notices = ChangeNotices(settings.redis.client, settings.cluster_name)
        try:
            notices.publish(result[0])
        except Exception as exc:
            if not quiet_notice:
                raise
            logger.debug("cluster-beat: change notice failed: %s", mask_url(repr(exc)))
        finally:
            notices.close()
    return result, source


class Opened:
    """``with Opened(app, store, settings) as st``: the caller's *store* when given (left open), else
    one opened read-only for the block (:func:`open_store`) and closed after it."""

    def __init__(self, app: Any, store: Optional[ClaimStore], settings: Optional[Settings] = None) -> None:
        self.app, self.store, self.settings, self.own = app, store, settings, store is None

    def __enter__(self) -> ClaimStore:
        if self.store is None:
            self.store = open_store(self.app, self.settings)
        return self.store

    def __exit__(self, *exc: object) -> None:
        if self.own and self.store is not None:
            self.store.close()


def _app_zone_name(app: Any) -> str:
    try:  # the zone rules without a zone of their own really run in (local with enable_utc=False)
        return zone_name(app_zone(app))
    except ScheduleError:
        zone = app.conf.timezone
        return str(getattr(zone, "key", zone)) if zone else "UTC"


def _describe(app: Any, schedule: Any) -> Tuple[str, Optional[str]]:
    """(text, zone) of a rule as operators read it: its exact text form, but a Celery ``crontab``
    (Celery's own ``celery.backend_cleanup``, converted) as its cron fields, never its repr."""
    try:
        text, zone = schedule_text(schedule)
    except (ScheduleError, ValueError, TypeError):
        text, zone = getattr(schedule, "expr", None) or repr(schedule), getattr(schedule, "tz_name", None)
    if text.startswith("crontab(") and getattr(schedule, "spec", None) is not None:
        try:
            text = cron_fields(schedule.spec)
        except (AttributeError, TypeError, ValueError, IndexError):
            pass  # the repr then: exact, if long
    if zone is None and (isinstance(schedule, cron) or (isinstance(schedule, every) and schedule.baseline)):
        zone = _app_zone_name(app)
    return text, zone


# ----------------------------------------------------------------------------- the reports


def cluster_status(app: Any, store: Optional[ClaimStore] = None, redis: Any = None, *,
                   settings: Optional[Settings] = None, paused_limit: Optional[int] = None) -> ClusterStatus:
    """The cluster now: leader and lease, nodes, store, schedule counts, unsent occurrences.

    *store* (open) and *redis* (a ``redis.Redis``) are used when given, else opened for the
    call. Redis trouble is reported in ``lease.error``, not raised; the store's is raised
    (StoreUnavailable). *paused_limit*: name at most that many paused schedules (all are counted)."""
    settings = settings or load_settings_of(app)
    with Opened(app, store, settings) as st:
        ov = st.overview(grace=settings.claim_grace, recent=RECENT_NODES, unsent_limit=UNSENT_SHOWN,
                         paused_limit=paused_limit)
    lease = _lease(settings, redis, ov.now)
    config_count = len(_config_names(app))
    if lease.enabled:
        leader, term = lease.holder, lease.term
    else:  # without a lease every replica schedules; the last to claim is the best answer
        leader, term = ov.term_node, (ov.term or None)
    nodes = []
    for n in ov.nodes:
        age = max(0.0, (ov.now - n.heartbeat_at).total_seconds())
        state = node_status(n.node, n.heartbeat_at, n.stopped_at, age, leader=leader, grace=settings.claim_grace)
        nodes.append(NodeInfo(node=n.node, state=state, started_at=n.started_at,
                              scheduling=n.scheduling and state in (NodeStatus.LEADER, NodeStatus.UP),
                              heartbeat_at=n.heartbeat_at, heartbeat_age=round(age, 3), clock_offset=n.clock_offset,
                              stopped_at=n.stopped_at if state == NodeStatus.STOPPED else None))
    paused = tuple(PausedInfo(name=c.name, paused_at=c.paused_at, paused_by=c.paused_by, paused_note=c.paused_note)
                   for c in ov.paused_rows)
    unsent = tuple(UnsentOccurrence(schedule=r.schedule, scheduled_at=r.scheduled_at, claimed_at=r.claimed_at,
                                    node=r.node, attempts=r.attempts, reason=r.reason,
                                    age=round((ov.now - r.claimed_at).total_seconds(), 3))
                   for r in ov.unsent_rows)
    return ClusterStatus(
        cluster_name=settings.cluster_name, now=ov.now, db_url=mask_url(settings.db_url),
        schema_version=ov.schema_version, code_schema_version=SCHEMA_VERSION, leader=leader, term=term,
        store_term=ov.term, lease=lease, nodes=tuple(nodes), schedules=config_count + ov.stored_schedules,
        config_schedules=config_count, stored_schedules=ov.stored_schedules, paused=ov.paused,
        claim_grace=settings.claim_grace, unsent=ov.unsent, unsent_shown=unsent,
        paused_count=ov.paused_count if ov.paused_count is not None else len(ov.paused), paused_details=paused,
    )


def node_status(node: str, heartbeat_at: datetime, stopped_at: Optional[datetime], age: float, *,
                leader: Optional[str], grace: float) -> NodeStatus:
    """A node's :class:`NodeStatus`: ``stopped`` once it recorded a clean stop and has not
    heartbeated since; else ``leader`` (the lease holder), ``up`` (heartbeat within *grace*
    seconds) or ``gone`` (its heartbeat lapsed without a clean stop: crashed, killed, cut off)."""
    if stopped_at is not None and heartbeat_at <= stopped_at:
        return NodeStatus.STOPPED
    if leader is not None and node == leader:
        return NodeStatus.LEADER
    return NodeStatus.UP if age <= grace else NodeStatus.GONE


def _lease(settings: Settings, redis: Any, now: datetime) -> LeaseInfo:
    if settings.redis is None:
        return LeaseInfo(enabled=False, redis_url=None, key=None, holder=None, term=None, expires_in=None,
                         expires_at=None)
    key = lease_keys(settings.cluster_name)[0]
    url = mask_url(settings.redis.url)
    client = redis if redis is not None else settings.redis.client()
    try:
        pipe = client.pipeline(transaction=False)
        pipe.get(key)
        pipe.pttl(key)
        value, pttl = pipe.execute()
    except Exception as exc:  # redis errors, OSError: reported, not raised
        first = (str(exc).strip().splitlines() or [""])[0]
        return LeaseInfo(enabled=True, redis_url=url, key=key, holder=None, term=None, expires_in=None,
                         expires_at=None, error=mask_url(f"{type(exc).__name__}: {first}"))
    finally:
        if redis is None:
            client.close()
    if value is None:
        return LeaseInfo(enabled=True, redis_url=url, key=key, holder=None, term=None, expires_in=None,
                         expires_at=None)
    term, holder = _parse_value(value)
    expires_in = pttl / 1000.0 if isinstance(pttl, int) and pttl >= 0 else None
    return LeaseInfo(enabled=True, redis_url=url, key=key, holder=holder or None, term=term,
                     expires_in=expires_in,
                     expires_at=now + timedelta(seconds=expires_in) if expires_in is not None else None)


def schedule_list(app: Any, store: Optional[ClaimStore] = None) -> List[ScheduleInfo]:
    """Every schedule, config then stored, each by name: its rule, computed next fire, last
    occurrence and outcome, counters, and whether an operator paused it.

    A config entry that does not validate raises ConfigError (beat would refuse to start);
    a stored row that does not is listed with its ``problem``. (The status page shows the
    first few by relevance instead: :mod:`.schedulepage`.)"""
    entries = config_entries(app)
    with Opened(app, store) as st:
        stored = st.stored_list()
        reads = ScheduleReads(app, st)
    return [reads.config_info(name, entries[name]) for name in sorted(entries)] + [reads.stored_info(r) for r in stored]


class ScheduleReads:
    """What ``list`` and the status page show of schedules besides their definitions (state,
    last occurrence, controls), read in one go: for *names*, or for every schedule (None)."""

    def __init__(self, app: Any, st: ClaimStore, names: Optional[List[str]] = None,
                 now: Optional[datetime] = None, settings: Optional[Settings] = None) -> None:
        self.app = app
        self._settings = settings
        self.now = now = st.db_now() if now is None else now
        self.states = {s.name: s for s in st.schedule_states(names)}
        self.latest = latest = st.latest_claims(names)
        # An instant's occurrences are claimed (and, by the overlap guard, skipped) up to a moment
        # before it: such a row is the next fire, not the last outcome, whatever its status. The
        # last is the newest occurrence whose instant has come (a few schedules at most).
        ahead = sorted({n for n, r in latest.items() if r.scheduled_at > now}
                       | {n for n, s in self.states.items()
                          if s.last_occurrence is not None and s.last_occurrence > now})
        before = st.latest_claims_before(ahead, now)
        self.last_at: Dict[str, Optional[datetime]] = {}
        for name in ahead:
            row = before.get(name)
            self.last_at[name] = row.scheduled_at if row is not None else None
            if row is None:
                latest.pop(name, None)
            else:
                latest[name] = row
        self.controls = {c.name: c for c in st.controls(names, active_only=True)}
        self._ledger: Dict[str, bool] = {}

    @property
    def settings(self) -> Optional[Settings]:
        """The app's settings, read on first use, for the overlap policy an entry gets by default
        (None when they do not validate: the policy is then not shown, the list still is)."""
        if self._settings is None:
            try:
                self._settings = load_settings_of(self.app)
            except ConfigError:
                self._settings = False  # type: ignore[assignment]  # tried: do not read them again
        return self._settings or None

    def overlap(self, entry: Entry) -> Optional[str]:
        """*entry*'s overlap policy as the leader applies it (``OverlapGuard.policy``, which this
        layer may not import: the same rules): as written on the entry or in ``cluster_beat_overlap``;
        by default ``skip`` for a ledger task, ``allow`` for one whose results are ignored."""
        if entry.overlap:
            return OverlapPolicy(entry.overlap).value
        settings = self.settings
        if settings is None:
            return None
        if settings.overlap_explicit:
            return settings.overlap.value
        ledger = self._ledger.get(entry.task)
        if ledger is None:
            ledger = self._ledger[entry.task] = uses_ledger(self.app, entry.task)
        if ledger:
            return OverlapPolicy.SKIP.value
        if settings.overlap != OverlapPolicy.ALLOW and ignores_results(self.app, entry):
            return OverlapPolicy.ALLOW.value
        return settings.overlap.value

    def info(self, name: str, task: str, source: str, rule: Any, text: str, zone: Optional[str], enabled: bool,
             owner: Optional[str] = None, description: str = "", problem: Optional[str] = None,
             overlap: Optional[str] = None, ended_at: Optional[datetime] = None) -> ScheduleInfo:
        control = self.controls.get(name)
        paused = bool(control and control.paused)
        state = self.states.get(name)
        last = self.latest.get(name)
        rule = self.bound(name, rule)
        next_fire = None
        ended = ended_at is not None
        if rule is not None and enabled and not paused:
            try:
                next_fire = rule.next_fire(self.now)
                ended = ended or next_fire is None
            except (ScheduleError, ValueError):
                next_fire = None
        counters = Counters(**{f.name: getattr(state, f.name) for f in dataclasses.fields(Counters)}) \
            if state is not None else Counters()
        return ScheduleInfo(
            name=name, task=task, source=source, schedule=text, zone=zone, enabled=enabled, paused=paused,
            paused_at=control.paused_at if paused and control else None,
            paused_by=control.paused_by if paused and control else None,
            run_requested_at=control.run_requested_at if control and control.run_request else None,
            next_fire=next_fire,
            last_occurrence=self.last_at[name] if name in self.last_at else (state.last_occurrence if state else None),
            last_status=last.status if last else None, last_run_state=last.run_state if last else None,
            last_reason=last.reason if last else None, last_sent_at=state.last_sent_at if state else None,
            last_error=state.last_error if state else None, last_error_at=state.last_error_at if state else None,
            counters=counters, owner=owner, description=description or "", problem=problem,
            paused_note=control.paused_note if paused and control else None, overlap=overlap,
            rule=rule_words(rule, zone) if rule is not None else None,
            compact=compact(rule) if rule is not None else None,
            start_at=getattr(rule, "start_at", None), end_at=getattr(rule, "end_at", None),
            max_runs=getattr(rule, "max_runs", None), ended=ended, ended_at=ended_at,
        )

    def bound(self, name: str, rule: Any) -> Any:
        """*rule* with the origin its ``max_runs`` counts from when only the store knows it (a config
        entry without ``start_at``: its registration), as the leader binds it."""
        state = self.states.get(name)
        if getattr(rule, "needs_origin", False) and state is not None and state.registered_at is not None:
            return rule.with_origin(state.registered_at)
        return rule

    def config_info(self, name: str, entry: Entry) -> ScheduleInfo:
        text, zone = _describe(self.app, entry.schedule)
        return self.info(name, entry.task, "config", entry.schedule, text, zone, entry.enabled,
                         description=entry.description, overlap=self.overlap(entry))

    def stored_info(self, row: StoredRow) -> ScheduleInfo:
        try:
            entry = entry_from_row(row, app=self.app)
        except ConfigError as exc:
            return self.info(row.name, row.task, "stored", None, row.schedule, row.zone, row.enabled, owner=row.owner,
                             description=row.description or "", problem="; ".join(exc.problems))
        text, zone = _describe(self.app, entry.schedule)
        return self.info(row.name, row.task, "stored", entry.schedule, text, zone, row.enabled, owner=row.owner,
                         description=row.description or "", overlap=self.overlap(entry), ended_at=row.ended_at)


def paused_info(store: ClaimStore, name: str) -> Optional[PausedInfo]:
    """Who paused schedule *name*, when and why; None when it is not paused."""
    for c in store.controls([name]):
        if c.paused:
            return PausedInfo(name=c.name, paused_at=c.paused_at, paused_by=c.paused_by, paused_note=c.paused_note)
    return None


def history(app: Any, name: str, limit: int = 50, store: Optional[ClaimStore] = None) -> List[HistoryRow]:
    """The last *limit* occurrences of schedule *name*, newest first (until pruned).

    :class:`NoSuchSchedule` when *name* is neither a schedule nor has any recorded occurrence
    (a removed stored schedule keeps its history)."""
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ValueError(f"limit must be a positive integer, got {limit!r}")
    with Opened(app, store) as st:
        rows = st.recent_claims(name, limit=limit)
        if not rows:
            schedule_source(app, name, st)  # raises NoSuchSchedule for a name nobody knows
    return [HistoryRow.from_claim(r) for r in rows]
