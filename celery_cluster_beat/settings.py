"""The ``cluster_beat_*`` settings, read once from the Celery config and validated.

Every problem is collected and reported together (naming the setting), so an
operator fixes the configuration in one round trip rather than one error per
restart.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

from .errors import ConfigError

CATCHUP_POLICIES = ("latest", "all", "none")
OVERLAP_POLICIES = ("skip", "allow", "buffer_one", "replace")
DEFAULT_DB_URL = "sqlite:///celerybeat-cluster.sqlite3"


@dataclass(frozen=True)
class Settings:
    db_url: str
    node_id: str
    redis_url: Optional[str]  # None: no lease
    lock_ttl: float
    catchup: str
    catchup_window: Optional[float]
    catchup_max: int
    overlap: str
    max_run_time: float
    jitter: float
    claim_retention: float
    prune_interval: float
    claim_grace: float

    def __repr__(self) -> str:  # URLs may carry passwords: never print them
        from .urls import mask_url

        fields = ", ".join(
            f"{k}={mask_url(v) if k.endswith('_url') and v else v!r}" for k, v in self.__dict__.items()
        )
        return f"Settings({fields})"


def _positive(name: str, value: Any, problems: List[str], *, allow_zero: bool = False, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        problems.append(f"setting {name}: expected a number of seconds, got {value!r}")
        return None
    if value < 0 or (value == 0 and not allow_zero):
        problems.append(f"setting {name}: must be {'zero or ' if allow_zero else ''}positive, got {value!r}")
        return None
    return float(value)


def _choice(name: str, value: Any, choices, problems: List[str]) -> Optional[str]:
    if value not in choices:
        problems.append(f"setting {name}: expected one of {', '.join(choices)}, got {value!r}")
        return None
    return value


def default_redis_url(conf) -> Optional[str]:
    """The broker URL when it is Redis (plain, TLS or Sentinel); else no lease."""
    broker = conf.broker_url or ""
    if isinstance(broker, (list, tuple)):
        broker = broker[0] if broker else ""
    if not isinstance(broker, str):
        return None
    if broker.split("://", 1)[0] in ("redis", "rediss", "sentinel"):
        return broker
    return None


def load_settings(conf, *, has_result_backend: Callable[[], bool]) -> Settings:
    """Read and validate every ``cluster_beat_*`` setting from Celery's *conf*."""
    problems: List[str] = []
    get = conf.get

    db_url = get("cluster_beat_db_url") or DEFAULT_DB_URL
    if not isinstance(db_url, str) or "://" not in db_url:
        problems.append(f"setting cluster_beat_db_url: expected an SQLAlchemy URL, got {db_url!r}")

    node_id = get("cluster_beat_node_id") or f"{socket.gethostname()}:{os.getpid()}"
    if not isinstance(node_id, str) or len(node_id) > 200:
        problems.append(f"setting cluster_beat_node_id: expected a string of at most 200 characters, got {node_id!r}")

    redis_url = get("cluster_beat_redis_url")
    if redis_url is None:
        redis_url = default_redis_url(conf)
    elif not isinstance(redis_url, str):
        problems.append(f"setting cluster_beat_redis_url: expected a redis:// URL or '', got {type(redis_url).__name__}")
        redis_url = None
    elif redis_url == "":
        redis_url = None
    else:
        from .redisconn import redis_client_from_url

        options = conf.broker_transport_options if redis_url == conf.broker_url else None
        try:  # builds a client without connecting: checks the URL's form and options
            redis_client_from_url(redis_url, transport_options=options or {}).close()
        except ValueError as exc:
            problems.append(f"setting cluster_beat_redis_url: {exc}")

    def seconds(name: str, default, **kw):
        value = get(name)
        return _positive(name, default if value is None else value, problems, **kw)

    lock_ttl = seconds("cluster_beat_lock_ttl", 5.0)
    if lock_ttl is not None and lock_ttl < 0.5:
        problems.append(f"setting cluster_beat_lock_ttl: must be at least 0.5 s, got {lock_ttl!r}")
    catchup = _choice("cluster_beat_catchup", get("cluster_beat_catchup") or "latest", CATCHUP_POLICIES, problems)
    catchup_window = _positive("cluster_beat_catchup_window", get("cluster_beat_catchup_window"), problems, allow_none=True)
    catchup_max = get("cluster_beat_catchup_max")
    catchup_max = 100 if catchup_max is None else catchup_max
    if isinstance(catchup_max, bool) or not isinstance(catchup_max, int) or catchup_max < 1:
        problems.append(f"setting cluster_beat_catchup_max: expected a positive integer, got {catchup_max!r}")
    overlap_default = "skip" if has_result_backend() else "allow"
    overlap = _choice("cluster_beat_overlap", get("cluster_beat_overlap") or overlap_default, OVERLAP_POLICIES, problems)
    max_run_time = seconds("cluster_beat_max_run_time", 600.0)
    jitter = seconds("cluster_beat_jitter", 0.0, allow_zero=True)
    retention = seconds("cluster_beat_claim_retention", 7 * 86400.0)
    prune_interval = seconds("cluster_beat_prune_interval", 60.0)
    claim_grace = seconds("cluster_beat_claim_grace", 10.0)
    zone = get("timezone")  # entries without a zone of their own follow it: check it before anything opens
    if isinstance(zone, str) and zone:
        from .errors import ScheduleError
        from .tzwall import get_zone

        try:
            get_zone(zone)
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
    )
