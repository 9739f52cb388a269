"""The ``cluster_beat_*`` settings, read once from the Celery config and validated.

Every problem is collected and reported together (naming the setting), so an
operator fixes the configuration in one round trip rather than one error per
restart.
"""
from __future__ import annotations

import difflib
import os
import socket
from dataclasses import dataclass, fields
from typing import Any, Callable, FrozenSet, List, Optional

from ..base import MAX_NODE_ID_LENGTH
from ..errors import ConfigError
from ..leader.urls import MASK, mask_url
from ..schedules.celery_types import local_zone
from ..schedules.errors import ScheduleError
from ..schedules.tzwall import get_zone
from .celeryconf import RedisOptions, default_redis_url, redis_options
from .options import SETTING as STORED_OPTIONS_SETTING
from .options import allowed_stored_options
from .values import (MAX_CATCHUP, CatchupPolicy, OverlapPolicy, choice_problem, count_problem, seconds_problem,
                     shown, text_problem)

DEFAULT_DB_URL = "sqlite:///celerybeat-cluster.sqlite3"
#: Celery's default ``beat_schedule_filename``: with it (or none) the claim file keeps the name above.
CELERY_SCHEDULE_FILENAME = "celerybeat-schedule"
#: Appended to any other schedule file's path to name the claim database derived from it.
DERIVED_DB_SUFFIX = "-cluster.sqlite3"


#: Longest cluster name: it is part of Redis key names.
MAX_CLUSTER_NAME_LENGTH = 200
#: Most stored schedules with metrics series of their own: each costs about 2 KB of every scrape.
MAX_METRICS_STORED = 10_000


#: Fields never printed (tokens).
_SECRETS = ("http_token", "http_actions_token")


@dataclass(frozen=True)
class Settings:
    db_url: str
    node_id: str
    redis_url: Optional[str]  # None: no lease
    lock_ttl: float
    catchup: CatchupPolicy
    catchup_window: Optional[float]
    catchup_max: int
    overlap: OverlapPolicy
    max_run_time: float
    jitter: float
    claim_retention: float
    prune_interval: float
    claim_grace: float
    #: How the lease's Redis client is built (None: no lease); validated by building one.
    redis: Optional[RedisOptions] = None
    #: Names the lease: the nodes of one cluster share it, other clusters on the same Redis do not.
    cluster_name: str = "celery"
    #: Whether ``cluster_beat_overlap`` was set: an explicit policy is honoured (or refused at start-up
    #: when it cannot be), while the default guards only entries whose runs it can observe.
    overlap_explicit: bool = False
    #: Port of beat's HTTP server (/metrics, /healthz, status page); None: no server, no metrics.
    http_port: Optional[int] = None
    #: Address the HTTP server binds to.
    http_host: str = "127.0.0.1"
    #: Whether metrics carry a ``schedule`` label (off for large schedule sets).
    metrics_per_schedule: bool = True
    #: At most this many schedules besides the config's entries have metrics series of their own (0: none).
    metrics_stored_max: int = 500
    #: Whether the HTTP server shows the status page and /metrics (False: /healthz alone).
    http_page: bool = True
    #: Bearer token the page and /metrics require (None: none); never printed.
    http_token: Optional[str] = None
    #: Token that turns the dashboard's actions on (run now, pause, resume; None: read-only); never printed.
    http_actions_token: Optional[str] = None
    #: Seconds any one claim-database call may take, connecting included (beat, worker ledger, API, CLI).
    db_timeout: float = 15.0
    #: Options a stored schedule may set beyond the default allow-list (config/options.py).
    stored_options_allowed: FrozenSet[str] = frozenset()

    def __repr__(self) -> str:  # URLs may carry passwords: never print them
        shown = ", ".join(
            f"{f.name}={mask_url(v) if f.name.endswith('_url') and v else MASK if f.name in _SECRETS and v else v!r}"
            for f in fields(self) for v in (getattr(self, f.name),)
        )
        return f"Settings({shown})"


#: Fields of :class:`Settings` that are not settings of their own (derived from one that is).
DERIVED_FIELDS = frozenset({"redis", "overlap_explicit"})
#: Settings read outside :func:`load_settings` (the worker's ledger reads its grace itself).
OTHER_SETTINGS = frozenset({"cluster_beat_worker_grace"})
#: What every setting of this package starts with.
PREFIX = "cluster_beat_"


def known_settings() -> FrozenSet[str]:
    """Every ``cluster_beat_*`` setting this release reads: one per field of :class:`Settings` (so a
    setting added there is known here without another list to keep), plus :data:`OTHER_SETTINGS`."""
    return frozenset(PREFIX + f.name for f in fields(Settings) if f.name not in DERIVED_FIELDS) | OTHER_SETTINGS


def unknown_settings(conf: Any) -> List[str]:
    """One sentence per key of Celery's *conf* that looks like a setting of ours but is not read:
    a misspelt name (``cluster_beat_lock_tll``), an upper-case one Celery does not map
    (``CLUSTER_BEAT_LOCK_TTL`` without a namespace), each with the closest known name.

    A misspelt setting is silently ignored otherwise, and its default runs in its place. Keys
    with the app's namespace (``config_from_object(..., namespace="CELERY")``: ``CELERY_CLUSTER_BEAT_*``)
    are compared in that form, as Celery reads them. Names close to ours without our prefix
    (``clusterbeat_lock_ttl``) count too; other keys of the app's own are left alone."""
    known = known_settings()
    try:
        keys = [k for k in conf.keys() if isinstance(k, str)]
    except Exception:  # not Celery's Settings (a plain mapping without keys()): nothing to compare
        return []
    prefix = getattr(conf, "prefix", None) or ""  # known once the conf is read (keys() above)

    def as_read(name: str) -> str:  # a known name as this conf spells it (Celery's match_case)
        if not prefix:
            return name
        return (prefix + name).upper() if prefix.isupper() else (prefix + name).lower()

    readable = known | {as_read(n) for n in known}
    out = []
    names = sorted(known)
    for key in sorted(set(keys) - readable):
        namespaced = bool(prefix) and key.upper().startswith(prefix.upper())
        low = (key[len(prefix):] if namespaced else key).lower()
        if not low.startswith(PREFIX) and not difflib.get_close_matches(low, names, n=1, cutoff=0.85):
            continue  # a setting of Celery's or of the app's own
        if low.startswith(PREFIX):  # compared without the prefix, which every name shares
            tails = {n[len(PREFIX):]: n for n in names}
            close = [tails[t] for t in difflib.get_close_matches(low[len(PREFIX):], sorted(tails), n=1, cutoff=0.6)]
        else:
            close = difflib.get_close_matches(low, names, n=1, cutoff=0.6)
        if not close:
            out.append(f"setting {key}: not a setting celery-cluster-beat reads, so it is ignored "
                       "(the README's Settings table lists them)")
            continue
        meant = as_read(close[0]) if namespaced else close[0]
        why = "Celery reads settings in lower case" if low == close[0] and not namespaced else \
            "not a setting celery-cluster-beat reads"
        out.append(f"setting {key}: {why}, so it is ignored; did you mean {meant}?")
    return out


def default_db_url(conf: Any, schedule_filename: Any = None) -> str:
    """The claim store's URL when ``cluster_beat_db_url`` is unset: derived from beat's schedule file.

    The file is *schedule_filename* (``celery beat -s``, which only beat is given) or else
    the conf's ``beat_schedule_filename``. Celery's default ``celerybeat-schedule`` (or
    none) keeps :data:`DEFAULT_DB_URL`, ``celerybeat-cluster.sqlite3`` in the working
    directory; any other file ``F`` gives ``sqlite:///<F made absolute>-cluster.sqlite3``.
    Workers and the stored-schedules API read only the conf, so they agree with beat when
    the file is set as ``beat_schedule_filename``; ``-s`` alone needs ``cluster_beat_db_url``.

    :class:`ConfigError` naming the setting when the file name cannot make a SQLite URL.
    """
    if schedule_filename:
        name, filename = "schedule_filename (celery beat -s)", schedule_filename
    else:
        name, filename = "beat_schedule_filename", conf.get("beat_schedule_filename")
    if not filename:
        return DEFAULT_DB_URL
    try:
        path = os.fspath(filename)
    except TypeError:
        path = None
    if not isinstance(path, str):
        raise ConfigError(f"setting {name}: expected a file path, got {filename!r}")
    path = os.path.abspath(path)
    if path == os.path.abspath(CELERY_SCHEDULE_FILENAME):
        return DEFAULT_DB_URL
    if "?" in path or "%" in path:
        raise ConfigError(f"setting {name}: {filename!r} contains '?' or '%', which a SQLite URL cannot carry "
                          "as is; set cluster_beat_db_url")
    return f"sqlite:///{path}{DERIVED_DB_SUFFIX}"


def load_settings(conf: Any, *, has_result_backend: Callable[[], bool], app_name: Optional[str] = None,
                  schedule_filename: Optional[str] = None) -> Settings:
    """Read and validate every ``cluster_beat_*`` setting from Celery's *conf*.

    *app_name* (the Celery app's ``main``) is the default cluster name. *schedule_filename*
    (beat's ``-s``) names the default claim database when ``cluster_beat_db_url`` is unset
    (:func:`default_db_url`)."""
    problems: List[str] = []
    get = conf.get

    def seconds(name: str, default: Any, *, zero_ok: bool = False) -> Any:
        value = get(name)
        value = default if value is None else value
        problem = seconds_problem(value, zero_ok=zero_ok)
        if problem:
            problems.append(f"setting {name}: {problem}")
            return None
        return float(value)

    def choice(name: str, default: Any, kind: Any) -> Any:
        value = get(name) or default
        problem = choice_problem(value, kind)
        if problem:
            problems.append(f"setting {name}: {problem}")
            return None
        return kind(value)

    db_url = get("cluster_beat_db_url")
    if not db_url:
        try:
            db_url = default_db_url(conf, schedule_filename)
        except ConfigError as exc:
            problems.extend(exc.problems)
            db_url = DEFAULT_DB_URL
    if not isinstance(db_url, str) or "://" not in db_url:
        problems.append(f"setting cluster_beat_db_url: expected an SQLAlchemy URL, got {mask_url(repr(db_url))}")

    node_id = get("cluster_beat_node_id") or f"{socket.gethostname()}:{os.getpid()}"
    reason = text_problem(node_id, limit=MAX_NODE_ID_LENGTH, what="a node name")
    if reason:  # it is written in the claim table's node columns
        problems.append(f"setting cluster_beat_node_id: expected a string of at most "
                        f"{MAX_NODE_ID_LENGTH} characters, got {shown(node_id)}: {reason}")

    cluster_name = get("cluster_beat_cluster_name") or app_name or "celery"
    reason = text_problem(cluster_name, limit=MAX_CLUSTER_NAME_LENGTH, what="a cluster name")
    if reason:
        problems.append(f"setting cluster_beat_cluster_name: expected a string of at most "
                        f"{MAX_CLUSTER_NAME_LENGTH} characters, got {shown(cluster_name)}: {reason}")

    lock_ttl = seconds("cluster_beat_lock_ttl", 5.0)
    if lock_ttl is not None and lock_ttl < 0.5:
        problems.append(f"setting cluster_beat_lock_ttl: must be at least 0.5 s, got {lock_ttl!r}")

    redis_url = get("cluster_beat_redis_url")
    if redis_url is None:
        redis_url = default_redis_url(conf)
    elif not isinstance(redis_url, str):
        problems.append(f"setting cluster_beat_redis_url: expected a Redis URL (redis://, rediss://, unix://, "
                        f"sentinel://, redis+cluster:// for a Redis Cluster) or '', got {type(redis_url).__name__}")
        redis_url = None
    redis = None
    if redis_url:
        redis = redis_options(conf, redis_url, lock_ttl or 5.0)
        try:  # builds the very client the lease will use, without connecting
            redis.client().close()
        except ValueError as exc:
            problems.append(f"setting cluster_beat_redis_url: {exc}")
    else:
        redis_url = None

    catchup = choice("cluster_beat_catchup", CatchupPolicy.LATEST, CatchupPolicy)
    catchup_window = get("cluster_beat_catchup_window")
    if catchup_window is not None:
        catchup_window = seconds("cluster_beat_catchup_window", None)
    elif get("beat_cron_starting_deadline") is not None:  # Celery's own bound on late runs, as the default
        catchup_window = seconds("beat_cron_starting_deadline", None)
    catchup_max = get("cluster_beat_catchup_max")
    catchup_max = 100 if catchup_max is None else catchup_max
    reason = count_problem(catchup_max, limit=MAX_CATCHUP)
    if reason:
        problems.append(f"setting cluster_beat_catchup_max: {reason}")
    overlap_default = OverlapPolicy.SKIP if has_result_backend() else OverlapPolicy.ALLOW
    overlap = choice("cluster_beat_overlap", overlap_default, OverlapPolicy)
    overlap_explicit = bool(get("cluster_beat_overlap"))
    max_run_time = seconds("cluster_beat_max_run_time", 600.0)
    jitter = seconds("cluster_beat_jitter", 0.0, zero_ok=True)
    retention = seconds("cluster_beat_claim_retention", 7 * 86400.0)
    prune_interval = seconds("cluster_beat_prune_interval", 60.0)
    claim_grace = seconds("cluster_beat_claim_grace", 10.0)
    try:
        db_timeout = db_timeout_setting(conf)
    except ConfigError as exc:
        problems.extend(exc.problems)
        db_timeout = None
    http_port = get("cluster_beat_http_port")
    if http_port is not None and (isinstance(http_port, bool) or not isinstance(http_port, int)
                                  or not 0 <= http_port <= 65535):
        problems.append(f"setting cluster_beat_http_port: expected a port number 0-65535 (0: any free port) "
                        f"or None (no HTTP server), got {shown(http_port)}")
    http_host = get("cluster_beat_http_host")
    http_host = "127.0.0.1" if http_host is None else http_host
    if not isinstance(http_host, str) or not http_host.strip():
        problems.append(f"setting cluster_beat_http_host: expected an address to bind to, got {shown(http_host)}")
    per_schedule = get("cluster_beat_metrics_per_schedule")
    per_schedule = True if per_schedule is None else per_schedule
    if not isinstance(per_schedule, bool):
        problems.append(f"setting cluster_beat_metrics_per_schedule: expected True or False, got {shown(per_schedule)}")
    stored_max = get("cluster_beat_metrics_stored_max")
    stored_max = 500 if stored_max is None else stored_max
    if isinstance(stored_max, bool) or not isinstance(stored_max, int) or not 0 <= stored_max <= MAX_METRICS_STORED:
        problems.append(f"setting cluster_beat_metrics_stored_max: expected a whole number from 0 (none) to "
                        f"{MAX_METRICS_STORED}, got {shown(stored_max)}")
    http_page = get("cluster_beat_http_page")
    http_page = True if http_page is None else http_page
    if not isinstance(http_page, bool):
        problems.append(f"setting cluster_beat_http_page: expected True or False (False: /healthz alone), "
                        f"got {type(http_page).__name__}")
    http_token = get("cluster_beat_http_token") or None
    if http_token is not None and (not isinstance(http_token, str) or len(http_token) < 16
                                   or not http_token.isascii() or not http_token.isprintable() or " " in http_token):
        problems.append("setting cluster_beat_http_token: expected a string of at least 16 printable ASCII "
                        "characters without spaces, or None (no token)")  # the value itself is never shown
    http_actions_token = get("cluster_beat_http_actions_token") or None
    if http_actions_token is not None and (
            not isinstance(http_actions_token, str) or len(http_actions_token) < 16 or not http_actions_token.isascii()
            or not http_actions_token.isprintable() or " " in http_actions_token):
        problems.append("setting cluster_beat_http_actions_token: expected a string of at least 16 printable ASCII "
                        "characters without spaces, or None (the dashboard stays read-only)")  # never shown
    elif http_actions_token is not None and http_actions_token == http_token:
        problems.append("setting cluster_beat_http_actions_token: must differ from cluster_beat_http_token "
                        "(whoever may read the page must not be able to act by that alone)")
    try:
        stored_options_allowed = allowed_stored_options(get(STORED_OPTIONS_SETTING))
    except ConfigError as exc:
        problems.extend(exc.problems)
        stored_options_allowed = frozenset()
    zone = get("timezone")  # entries without a zone of their own follow it: check it before anything opens
    if isinstance(zone, str) and zone:
        try:
            get_zone(zone)
        except ScheduleError as exc:
            problems.append(f"setting timezone: {exc}")
    elif not zone and not get("enable_utc", True):  # Celery's rule: the server's local zone
        try:
            local_zone()
        except ScheduleError as exc:
            problems.append(f"setting timezone: {exc}")

    if problems:
        raise ConfigError(problems)
    return Settings(
        db_url=db_url,
        node_id=node_id,
        redis_url=redis_url,
        lock_ttl=lock_ttl,
        catchup=catchup,
        catchup_window=catchup_window,
        catchup_max=catchup_max,
        overlap=overlap,
        max_run_time=max_run_time,
        jitter=jitter,
        claim_retention=retention,
        prune_interval=prune_interval,
        claim_grace=claim_grace,
        redis=redis,
        cluster_name=cluster_name,
        overlap_explicit=overlap_explicit,
        http_port=http_port,
        http_host=http_host,
        metrics_per_schedule=per_schedule,
        metrics_stored_max=stored_max,
        http_page=http_page,
        http_token=http_token,
        http_actions_token=http_actions_token,
        db_timeout=db_timeout,
        stored_options_allowed=stored_options_allowed,
    )


#: ``cluster_beat_db_timeout``'s default and range (seconds). The same default as the store's
#: (store.deadline.DEFAULT_DB_TIMEOUT), which a ClaimStore built without the setting uses.
DEFAULT_DB_TIMEOUT = 15.0
DB_TIMEOUT_RANGE = (0.5, 86400.0)


def db_timeout_setting(conf: Any) -> float:
    """``cluster_beat_db_timeout`` of Celery's *conf*, checked: what the worker's ledger store reads
    (it loads no other setting). :class:`ConfigError` naming the setting when it is wrong."""
    value = conf.get("cluster_beat_db_timeout")
    value = DEFAULT_DB_TIMEOUT if value is None else value
    problem = seconds_problem(value)
    low, high = DB_TIMEOUT_RANGE
    if problem is None and not low <= value <= high:
        problem = f"must be from {low:g} to {high:g} s, got {value!r}"
    if problem:
        raise ConfigError(f"setting cluster_beat_db_timeout: {problem}")
    return float(value)
