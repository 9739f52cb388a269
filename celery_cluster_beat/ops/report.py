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
* :func:`load_settings_of` ``(app) -> Settings``, :func:`open_store` ``(app, settings=None) -> ClaimStore``,
  :func:`schedule_source` ``(app, name, store) -> 'config' | 'stored'`` (:class:`NoSuchSchedule` otherwise)
"""
from __future__ import annotations

import dataclasses
import os
import socket
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Dict, List, Optional, Tuple

from ..config.celeryconf import default_entries, has_result_backend
from ..config.entries import Entry, build_entries
from ..config.settings import Settings, load_settings
from ..dynamic.convert import entry_from_row
from ..errors import ConfigError, ScheduleError, UnknownSchedule
from ..leader.lease import _parse_value, lease_keys
from ..leader.urls import mask_url
from ..schedules.celery_types import app_zone, cron, every
from ..schedules.tzwall import zone_name
from ..schedules.text import schedule_text
from ..store import SCHEMA_VERSION, ClaimRow, ClaimStatus, ClaimStore
from ..store.stored import StoredRow

__all__ = ["ClusterStatus", "LeaseInfo", "NodeInfo", "UnsentOccurrence", "ScheduleInfo", "Counters", "HistoryRow",
           "NoSuchSchedule", "cluster_status", "schedule_list", "history", "load_settings_of", "open_store",
           "schedule_source", "config_entries", "RECENT_NODES"]

#: A node whose last heartbeat is older than this (seconds) is left out of ``status``.
RECENT_NODES = 3600.0
#: At most this many of the unsent occurrences are listed (all are counted).
UNSENT_SHOWN = 20
#: The reason a claim row of an operator's run-now carries.
MANUAL = "manual"


class NoSuchSchedule(UnknownSchedule):
    """Neither the Celery config nor the stored schedules have this name."""

    def __str__(self) -> str:
        return f"no schedule is named {self.name!r} (neither a beat_schedule entry nor a stored schedule)"


def _plain(value: Any) -> Any:
    if isinstance(value, datetime):
        return value.isoformat()
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    return value


class _AsDict:
    def as_dict(self) -> Dict[str, Any]:
        """JSON-safe: times as ISO 8601 strings, nested records as dicts."""
        return _plain(self)


# ----------------------------------------------------------------------------- records


@dataclass(frozen=True)
class LeaseInfo(_AsDict):
    """The leader lease as Redis holds it right now."""

    enabled: bool  #: a Redis lease is configured (else every replica schedules and races on claims)
    redis_url: Optional[str]  #: masked
    key: Optional[str]  #: the lease's Redis key
    holder: Optional[str]  #: node id of the leader, None when nobody holds the lease
    term: Optional[int]  #: the holder's fencing term
    expires_in: Optional[float]  #: seconds until the key expires unless renewed
    expires_at: Optional[datetime]  #: the same, on the database's clock
    error: Optional[str] = None  #: why Redis could not be read


@dataclass(frozen=True)
class NodeInfo(_AsDict):
    """A beat node the claim store heard from recently."""

    node: str
    state: str  #: ``leader``, ``up`` (heartbeat within the claim grace) or ``gone``
    scheduling: bool  #: it said so in its last heartbeat
    started_at: datetime
    heartbeat_at: datetime
    heartbeat_age: float  #: seconds, by the database's clock
    clock_offset: Optional[float]  #: seconds: database clock minus the node's


@dataclass(frozen=True)
class UnsentOccurrence(_AsDict):
    """An occurrence claimed longer than the claim grace ago and still not sent."""

    schedule: str
    scheduled_at: datetime
    claimed_at: datetime
    node: str
    attempts: int
    reason: Optional[str]
    age: float  #: seconds since it was claimed


@dataclass(frozen=True)
class ClusterStatus(_AsDict):
    """``status``: who leads, who runs, where the store is, and what is late right now."""

    cluster_name: str
    now: datetime  #: the database's clock
    db_url: str  #: masked
    schema_version: Optional[int]  #: recorded in the store
    code_schema_version: int  #: this release's
    leader: Optional[str]  #: the lease holder; without a lease, the node that last raised the term
    term: Optional[int]  #: the lease holder's term; without a lease, the store's
    store_term: int  #: the highest term the store recorded
    lease: LeaseInfo
    nodes: Tuple[NodeInfo, ...]
    schedules: int  #: config + stored
    config_schedules: int
    stored_schedules: int
    paused: Tuple[str, ...]
    claim_grace: float
    #: Claimed more than ``claim_grace`` ago and not sent. Occurrences due but never claimed
    #: (no leader running) leave no row, so they cannot be counted here.
    unsent: int
    unsent_shown: Tuple[UnsentOccurrence, ...]


@dataclass(frozen=True)
class Counters(_AsDict):
    sent: int = 0
    skipped: int = 0
    missed: int = 0
    failed: int = 0
    claim_lost: int = 0
    resent: int = 0


@dataclass(frozen=True)
class ScheduleInfo(_AsDict):
    """``list``: one schedule, config or stored."""

    name: str
    task: str
    source: str  #: ``config`` (beat_schedule or Celery's default entries) or ``stored``
    schedule: str  #: cron fields, ``every <n>s [from HH:MM]``, or the rule's repr
    zone: Optional[str]  #: the zone the rule is read in (None: an interval on the UTC grid)
    enabled: bool
    paused: bool
    paused_at: Optional[datetime]
    paused_by: Optional[str]
    run_requested_at: Optional[datetime]  #: a run-now request still pending
    next_fire: Optional[datetime]  #: computed (None when disabled, paused or invalid); jitter not included
    last_occurrence: Optional[datetime]
    last_status: Optional[str]  #: the last occurrence's claim status (sent, skipped, missed, failed, claimed)
    last_run_state: Optional[str]  #: its run, when the task uses the ledger (running, succeeded, failed, retried)
    last_reason: Optional[str]
    last_sent_at: Optional[datetime]
    last_error: Optional[str]
    last_error_at: Optional[datetime]
    counters: Counters
    owner: Optional[str] = None
    description: str = ""
    problem: Optional[str] = None  #: a stored row that no longer validates

    @property
    def outcome(self) -> Optional[str]:
        """The last occurrence in one word or two: its run state if known, else its claim status."""
        if self.last_status is None:
            return None
        if self.last_run_state:
            return self.last_run_state
        if self.last_status in ("skipped", "failed") and self.last_reason:
            return f"{self.last_status} ({self.last_reason.split(':', 1)[0][:40]})"
        return self.last_status

    def as_dict(self) -> Dict[str, Any]:
        out = _plain(self)
        out["outcome"] = self.outcome
        return out


@dataclass(frozen=True)
class HistoryRow(_AsDict):
    """``history``: one occurrence, from its claim row and the worker's ledger."""

    schedule: str
    scheduled_at: datetime
    status: str
    manual: bool  #: an operator's run-now
    reason: Optional[str]
    node: str  #: the beat node that claimed it
    term: Optional[int]
    task_id: str
    claimed_at: datetime
    sent_at: Optional[datetime]
    attempts: int
    run_state: Optional[str]
    worker: Optional[str]
    started_at: Optional[datetime]
    finished_at: Optional[datetime]
    runtime: Optional[float]
    error: Optional[str]  #: the run's error, or why the occurrence was not sent
    duplicates: Optional[int]

    @classmethod
    def from_claim(cls, row: ClaimRow) -> "HistoryRow":
        error = row.run_error or (row.reason if row.status == "failed" else None)
        worker = f"{row.worker}:{row.worker_pid}" if row.worker and row.worker_pid else row.worker
        return cls(schedule=row.schedule, scheduled_at=row.scheduled_at, status=row.status,
                   manual=(row.reason or "").startswith(MANUAL), reason=row.reason, node=row.node, term=row.term,
                   task_id=row.task_id, claimed_at=row.claimed_at, sent_at=row.sent_at, attempts=row.attempts,
                   run_state=row.run_state, worker=worker, started_at=row.started_at, finished_at=row.finished_at,
                   runtime=row.runtime, error=error, duplicates=row.duplicates)


# ----------------------------------------------------------------------------- plumbing


def load_settings_of(app: Any) -> Settings:
    """The app's ``cluster_beat_*`` settings (ConfigError listing every problem)."""
    return load_settings(app.conf, has_result_backend=lambda: has_result_backend(app), app_name=app.main)


def open_store(app: Any, settings: Optional[Settings] = None) -> ClaimStore:
    """An open claim store of *app*'s cluster for operators' reads and controls; close it after use.

    A server that does not answer fails within 5 s (StoreUnavailable)."""
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
                        db_timeout=settings.db_timeout)
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


class _Opened:
    """Use the caller's store, or open one for the call and close it after."""

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
    """(text, zone) of a rule as operators read it."""
    try:
        text, zone = schedule_text(schedule)
    except (ScheduleError, ValueError, TypeError):
        text, zone = getattr(schedule, "expr", None) or repr(schedule), getattr(schedule, "tz_name", None)
    if zone is None and (isinstance(schedule, cron) or (isinstance(schedule, every) and schedule.baseline)):
        zone = _app_zone_name(app)
    return text, zone


# ----------------------------------------------------------------------------- the reports


def cluster_status(app: Any, store: Optional[ClaimStore] = None, redis: Any = None, *,
                   settings: Optional[Settings] = None) -> ClusterStatus:
    """The cluster now: leader and lease, nodes, store, schedule counts, unsent occurrences.

    *store* (open) and *redis* (a ``redis.Redis``) are used when given, else opened for the
    call. Redis trouble is reported in ``lease.error``, not raised; the store's is raised
    (StoreUnavailable)."""
    settings = settings or load_settings_of(app)
    with _Opened(app, store, settings) as st:
        ov = st.overview(grace=settings.claim_grace, recent=RECENT_NODES, unsent_limit=UNSENT_SHOWN)
    lease = _lease(settings, redis, ov.now)
    config_count = len(_config_names(app))
    if lease.enabled:
        leader, term = lease.holder, lease.term
    else:  # without a lease every replica schedules; the last to claim is the best answer
        leader, term = ov.term_node, (ov.term or None)
    nodes = []
    for n in ov.nodes:
        age = max(0.0, (ov.now - n.heartbeat_at).total_seconds())
        state = "leader" if leader is not None and n.node == leader else (
            "up" if age <= settings.claim_grace else "gone")
        nodes.append(NodeInfo(node=n.node, state=state, scheduling=n.scheduling, started_at=n.started_at,
                              heartbeat_at=n.heartbeat_at, heartbeat_age=round(age, 3), clock_offset=n.clock_offset))
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
    )


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
    a stored row that does not is listed with its ``problem``."""
    entries = config_entries(app)
    with _Opened(app, store) as st:
        stored = st.stored_list()
        now = st.db_now()
        states = {s.name: s for s in st.schedule_states()}
        latest = st.latest_claims()
        # An instant's occurrences are claimed up to a moment before it: that row is the next
        # fire, not the last outcome. Show the one before it (a few schedules at most).
        ahead = [n for n, r in latest.items() if r.status == ClaimStatus.CLAIMED and r.scheduled_at > now]
        before = st.latest_claims_before(ahead, now)
        last_at: Dict[str, Optional[datetime]] = {}
        for name in ahead:
            row = before.get(name)
            last_at[name] = row.scheduled_at if row is not None else None
            if row is None:
                del latest[name]
            else:
                latest[name] = row
        controls = {c.name: c for c in st.controls(active_only=True)}
    out: List[ScheduleInfo] = []

    def info(name: str, task: str, source: str, rule: Any, text: str, zone: Optional[str], enabled: bool,
             owner: Optional[str] = None, description: str = "", problem: Optional[str] = None) -> ScheduleInfo:
        control = controls.get(name)
        paused = bool(control and control.paused)
        state = states.get(name)
        last = latest.get(name)
        next_fire = None
        if rule is not None and enabled and not paused:
            try:
                next_fire = rule.next_fire(now)
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
            last_occurrence=last_at[name] if name in last_at else (state.last_occurrence if state else None),
            last_status=last.status if last else None, last_run_state=last.run_state if last else None,
            last_reason=last.reason if last else None, last_sent_at=state.last_sent_at if state else None,
            last_error=state.last_error if state else None, last_error_at=state.last_error_at if state else None,
            counters=counters, owner=owner, description=description or "", problem=problem,
        )

    for name in sorted(entries):
        e = entries[name]
        text, zone = _describe(app, e.schedule)
        out.append(info(name, e.task, "config", e.schedule, text, zone, e.enabled, description=e.description))
    for row in stored:
        out.append(_stored_info(app, row, info))
    return out


def _stored_info(app: Any, row: StoredRow, info: Any) -> ScheduleInfo:
    try:
        entry = entry_from_row(row, app=app)
    except ConfigError as exc:
        return info(row.name, row.task, "stored", None, row.schedule, row.zone, row.enabled, owner=row.owner,
                    description=row.description or "", problem="; ".join(exc.problems))
    text, zone = _describe(app, entry.schedule)
    return info(row.name, row.task, "stored", entry.schedule, text, zone, row.enabled, owner=row.owner,
                description=row.description or "")


def history(app: Any, name: str, limit: int = 50, store: Optional[ClaimStore] = None) -> List[HistoryRow]:
    """The last *limit* occurrences of schedule *name*, newest first (until pruned).

    :class:`NoSuchSchedule` when *name* is neither a schedule nor has any recorded occurrence
    (a removed stored schedule keeps its history)."""
    if not isinstance(limit, int) or isinstance(limit, bool) or limit < 1:
        raise ValueError(f"limit must be a positive integer, got {limit!r}")
    with _Opened(app, store) as st:
        rows = st.recent_claims(name, limit=limit)
        if not rows:
            schedule_source(app, name, st)  # raises NoSuchSchedule for a name nobody knows
    return [HistoryRow.from_claim(r) for r in rows]
