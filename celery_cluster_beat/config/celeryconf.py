"""What we read from Celery's own configuration, in one place.

Whether the app has a result backend, which Redis the lease uses and with
which client options (the broker's, when the lease shares the broker's Redis),
and the default entries Celery's beat would add. The options
validated at start-up are the very ones the lease's client is built from.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Mapping, Optional

from ..leader.redisconn import redis_client_from_url
from ..leader.urls import mask_url

#: The lease's Redis calls never block longer than this (seconds), nor longer than half the ttl.
MAX_REDIS_TIMEOUT = 2.0


def has_result_backend(app: Any) -> bool:
    """Whether results (and so task states) are stored anywhere."""
    backend = app.conf.result_backend
    return bool(backend) and str(backend).split(":", 1)[0] not in ("disabled", "none")


def default_redis_url(conf: Any) -> Optional[str]:
    """The broker URL when it is Redis (plain, TLS or Sentinel); else no lease."""
    broker = conf.broker_url or ""
    if isinstance(broker, (list, tuple)):
        broker = broker[0] if broker else ""
    if not isinstance(broker, str):
        return None
    if broker.split("://", 1)[0] in ("redis", "rediss", "sentinel"):
        return broker
    return None


@dataclass(frozen=True)
class RedisOptions:
    """How to build the lease's Redis client; :meth:`client` does not connect."""

    url: str
    transport_options: Mapping[str, Any] = field(default_factory=dict)
    ssl: Any = None
    socket_timeout: float = MAX_REDIS_TIMEOUT

    def client(self) -> Any:
        """A new ``redis.Redis``; ValueError (password masked) for a URL or option it cannot use."""
        return redis_client_from_url(self.url, transport_options=self.transport_options,
                                     ssl=self.ssl or None, socket_timeout=self.socket_timeout)

    def __repr__(self) -> str:  # never print a password
        return f"RedisOptions({mask_url(self.url)}, timeout={self.socket_timeout:g}s)"


def redis_options(conf: Any, url: str, lock_ttl: float) -> RedisOptions:
    """The lease's client options for *url*: the broker's transport options and TLS
    settings when *url* is the broker's URL, none otherwise."""
    same_as_broker = url == conf.broker_url
    return RedisOptions(
        url=url,
        transport_options=dict(conf.broker_transport_options or {}) if same_as_broker else {},
        ssl=(conf.broker_use_ssl or None) if same_as_broker else None,
        socket_timeout=min(MAX_REDIS_TIMEOUT, lock_ttl / 2),
    )


def default_entries(app: Any, present: Mapping[str, Any]) -> Dict[str, Dict[str, Any]]:
    """The ``beat_schedule`` items Celery's beat would add: ``celery.backend_cleanup`` at 04:00
    when results expire and the backend cannot expire them itself."""
    from celery.schedules import crontab

    conf = app.conf
    if "celery.backend_cleanup" in present or not conf.result_expires:
        return {}
    if not has_result_backend(app) or app.backend.supports_autoexpire:
        return {}
    return {
        "celery.backend_cleanup": {
            "task": "celery.backend_cleanup",
            "schedule": crontab("0", "4", "*"),
            "options": {"expires": 12 * 3600},
        }
    }
