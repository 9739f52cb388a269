"""Build the redis-py client the leader lease talks to.

One function, :func:`redis_client_from_url`, understands the URL forms a Celery
user already has in their configuration:

* ``redis://[[user]:password@]host[:port][/db]``
* ``rediss://...`` (TLS; ``ssl_cert_reqs`` and friends from the query string,
  from ``ssl_*`` transport options, or from a ``broker_use_ssl``-style dict)
* ``unix://[[user]:password@]/path/to/redis.sock[?db=N]``
* kombu's Sentinel form ``sentinel://[[user]:password@]host:port[/db][;sentinel://host2:port2...]``
  with the master name from the ``master_name`` transport option (or a
  ``master_name`` query parameter).
* a Redis Cluster: ``redis+cluster://[[user]:password@]host[:port][;redis+cluster://host2:port2...]``
  (``rediss+cluster://`` for TLS); the client is :class:`~.clusterconn.ClusterClient`,
  which connects on first use (:mod:`.clusterconn` says what differs).

Whatever the form, the client never blocks for long: ``socket_timeout`` and
``socket_connect_timeout`` are always set (our value wins over the URL's and the
transport options', since a lease must never wait forever), redis-py's own retry
is reduced to one immediate retry on a dropped connection (so a connection made
stale by a Redis restart is replaced transparently; time-outs are not retried,
the lease does its own back-off), and idle connections are health-checked.

Error messages never contain a password (:func:`~celery_cluster_beat.urls.mask_url`).
"""
from __future__ import annotations

import inspect
import ssl as _ssl
from typing import Any, Mapping
from urllib.parse import parse_qs, unquote, urlsplit

import redis
from redis.backoff import NoBackoff
from redis.connection import (
    AbstractConnection,
    Connection,
    ConnectionPool,
    SSLConnection,
    UnixDomainSocketConnection,
    parse_url,
    to_bool,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.retry import Retry
from redis.sentinel import Sentinel, SentinelManagedConnection, SentinelManagedSSLConnection

from .clusterconn import CLUSTER_DEFAULT_PORT, CLUSTER_NODE_KEYS, CLUSTER_SCHEMES, ClusterClient
from .urls import mask_url

__all__ = ["redis_client_from_url", "DEFAULT_HEALTH_CHECK_INTERVAL", "SENTINEL_DEFAULT_PORT"]

#: Seconds a pooled connection may sit idle before it is PINGed before use.
DEFAULT_HEALTH_CHECK_INTERVAL = 10
SENTINEL_DEFAULT_PORT = 26379

# The TLS options redis-py's SSLConnection takes. A ``broker_use_ssl`` dict may
# also spell them without the ``ssl_`` prefix (the ``ssl.wrap_socket`` names).
_SSL_KEYS = frozenset(
    name for name in inspect.signature(SSLConnection.__init__).parameters if name.startswith("ssl_")
)

# Everything a connection accepts from a URL query string (plus pool options).
_CONNECTION_KEYS = frozenset(
    name
    for cls in (AbstractConnection, Connection, SSLConnection, UnixDomainSocketConnection)
    for name, p in inspect.signature(cls.__init__).parameters.items()
    if name != "self" and p.kind is not inspect.Parameter.VAR_KEYWORD
) | {"max_connections", "timeout"}

_CERT_REQS = {
    "none": _ssl.CERT_NONE,
    "cert_none": _ssl.CERT_NONE,
    "optional": _ssl.CERT_OPTIONAL,
    "cert_optional": _ssl.CERT_OPTIONAL,
    "required": _ssl.CERT_REQUIRED,
    "cert_required": _ssl.CERT_REQUIRED,
}

# redis-py parse errors we may repeat verbatim: they never quote the URL. Anything
# else (urllib's port errors, for instance) may quote a fragment of an unencoded
# password, so we replace it with a generic hint.
_SAFE_PARSE_ERRORS = ("Invalid value for", "Redis URL must", "Invalid ssl verify flag")


def _lease_retry() -> Retry:
    """One immediate retry, on a dropped connection only (not on a time-out)."""
    return Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))


def _cert_reqs(value: Any, where: str) -> Any:
    if value is None or isinstance(value, _ssl.VerifyMode):
        return _ssl.CERT_NONE if value is None else value
    if isinstance(value, int) and not isinstance(value, bool):
        return _ssl.VerifyMode(value)
    if isinstance(value, str) and value.strip().lower() in _CERT_REQS:
        return _CERT_REQS[value.strip().lower()]
    raise ValueError(
        f"{where}: ssl_cert_reqs must be CERT_REQUIRED, CERT_OPTIONAL or CERT_NONE "
        f"(or required/optional/none), not {value!r}"
    )


def _ssl_options(source: Mapping[str, Any] | None, where: str, *, strict: bool) -> dict:
    """The TLS options of *source*, keys normalised to redis-py's ``ssl_*`` names.

    With *strict*, a key that is not a TLS option is an error (a ``broker_use_ssl``
    dict holds nothing else); otherwise non-TLS keys are ignored (transport options).
    """
    out: dict = {}
    if not source:
        return out
    unknown = []
    for key, value in source.items():
        key = str(key)
        name = key if key.startswith("ssl_") or not strict else "ssl_" + key
        if name in _SSL_KEYS:
            out[name] = value
        elif strict:
            unknown.append(key)
    if unknown:
        raise ValueError(f"{where}: unknown TLS option(s) {', '.join(sorted(map(str, unknown)))}")
    return out


def _normalise_ssl(options: dict, where: str) -> dict:
    if "ssl_cert_reqs" in options:
        options["ssl_cert_reqs"] = _cert_reqs(options["ssl_cert_reqs"], where)
    if isinstance(options.get("ssl_check_hostname"), str):
        options["ssl_check_hostname"] = bool(to_bool(options["ssl_check_hostname"]))
    return options


def _parse_error(url: str, exc: Exception) -> ValueError:
    text = str(exc)
    if not text.startswith(_SAFE_PARSE_ERRORS):
        text = "malformed URL (check the host and port, and that a password is percent-encoded)"
    return ValueError(f"invalid Redis URL {mask_url(url)}: {mask_url(text)}")


def _common_kwargs(socket_timeout: float, options: Mapping[str, Any]) -> dict:
    if socket_timeout is None or not socket_timeout > 0:
        raise ValueError(f"socket_timeout must be a positive number of seconds, not {socket_timeout!r}")
    kwargs = {
        "socket_timeout": float(socket_timeout),
        "socket_connect_timeout": float(socket_timeout),
        "health_check_interval": options.get("health_check_interval", DEFAULT_HEALTH_CHECK_INTERVAL),
        "retry": _lease_retry(),
    }
    if options.get("client_name"):
        kwargs["client_name"] = options["client_name"]
    return kwargs


class SentinelMasterRedis(redis.Redis):
    """The client of a Sentinel-managed master; closing it closes the sentinel clients too."""

    _ccb_sentinel: Sentinel | None = None

    def close(self) -> None:
        try:
            super().close()
        finally:
            sentinel, self._ccb_sentinel = self._ccb_sentinel, None
            for client in getattr(sentinel, "sentinels", ()) or ():
                try:
                    client.close()
                except Exception:  # pragma: no cover - best effort
                    pass


def redis_client_from_url(
    url: str,
    *,
    transport_options: Mapping[str, Any] | None = None,
    socket_timeout: float = 2.0,
    ssl: bool | Mapping[str, Any] | None = None,
) -> redis.Redis | ClusterClient:
    """Return a ``redis.Redis`` for *url* (see the module docstring for the forms), or for a
    ``redis+cluster://`` URL a :class:`~.clusterconn.ClusterClient`.

    :param transport_options: kombu-style transport options. Used here:
        ``master_name``, ``min_other_sentinels``, ``sentinel_kwargs`` (connection
        options for the sentinels themselves, e.g. their password),
        ``health_check_interval``, ``client_name`` and any ``ssl_*`` key. Other
        keys (``visibility_timeout``...) belong to the broker and are ignored.
    :param socket_timeout: seconds; used for both the socket and the connect time-out.
    :param ssl: ``True`` or a ``broker_use_ssl``-style dict (``ssl_cert_reqs``,
        ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``...; the names without
        ``ssl_`` are accepted too): use TLS even with ``redis://``/``sentinel://``.
        Precedence: URL query > *ssl* dict > ``ssl_*`` transport options.

    Building the client does not connect. Raises ``ValueError`` (password masked)
    for a URL or option it cannot use.
    """
    if not isinstance(url, str) or not url.strip():
        raise ValueError(f"a Redis URL is required, got {mask_url(repr(url))}")
    url = url.strip()
    options = dict(transport_options or {})
    where = mask_url(url)
    # TLS options: transport options < the ssl dict < the URL query. They only
    # *switch TLS on* when they come from the ssl argument (kombu's
    # broker_use_ssl semantics) or from the scheme (rediss://).
    tls = _ssl_options(options, where, strict=False)
    if isinstance(ssl, Mapping):
        tls.update(_ssl_options(ssl, where, strict=True))
    elif ssl not in (None, False, True):
        raise ValueError(f"{where}: ssl must be True, False, None or a dict of TLS options")
    want_tls = bool(ssl)

    scheme = url.split("://", 1)[0].lower() if "://" in url else ""
    if scheme == "sentinel":
        return _sentinel_client(url, options, socket_timeout, tls, want_tls)
    if scheme in CLUSTER_SCHEMES:
        return _cluster_client(url, options, socket_timeout, tls, want_tls)
    if scheme not in ("redis", "rediss", "unix"):
        raise ValueError(
            f"unsupported Redis URL {where}: use redis://, rediss://, unix://, "
            "sentinel://host:port[;sentinel://...] with a master_name, or "
            "redis+cluster://host:port (rediss+cluster:// with TLS) for a Redis Cluster"
        )

    try:
        kwargs = parse_url(url)
    except ValueError as exc:
        raise _parse_error(url, exc) from None
    unknown = sorted(k for k in kwargs if k not in _CONNECTION_KEYS and k not in ("host", "port", "path", "connection_class"))
    if unknown:
        raise ValueError(f"{where}: unknown query parameter(s) {', '.join(unknown)}")
    url_tls = {k: kwargs.pop(k) for k in list(kwargs) if k in _SSL_KEYS}
    if url_tls and scheme != "rediss":
        raise ValueError(
            f"{where}: TLS parameters ({', '.join(sorted(url_tls))}) in the query string need "
            "a rediss:// URL"
        )
    tls.update(url_tls)
    # The lease's own time-outs and retry policy win over the URL's.
    for key in ("socket_timeout", "socket_connect_timeout", "timeout", "retry_on_timeout", "retry_on_error"):
        kwargs.pop(key, None)
    kwargs.update(_common_kwargs(socket_timeout, options))

    if scheme == "unix":
        if want_tls:
            raise ValueError(f"{where}: TLS makes no sense for a unix:// socket")
        kwargs["connection_class"] = UnixDomainSocketConnection
    else:
        if not kwargs.get("host"):
            raise ValueError(f"invalid Redis URL {where}: no host")
        kwargs.setdefault("socket_keepalive", to_bool(options.get("socket_keepalive", True)))
        if scheme == "rediss" or want_tls:
            kwargs["connection_class"] = SSLConnection
            kwargs.update(_normalise_ssl(tls, where))
        else:
            kwargs["connection_class"] = Connection
    return _client_owning(ConnectionPool(**kwargs))


def _client_owning(pool: ConnectionPool) -> redis.Redis:
    """A client that closes *pool* when it is closed (``Redis.from_pool`` in redis-py >= 5)."""
    from_pool = getattr(redis.Redis, "from_pool", None)
    if from_pool is not None:
        return from_pool(pool)
    client = redis.Redis(connection_pool=pool)  # pragma: no cover - redis-py 4.x
    client.auto_close_connection_pool = True  # pragma: no cover
    return client  # pragma: no cover


def _sentinel_client(url: str, options: dict, socket_timeout: float, tls: dict, want_tls: bool) -> redis.Redis:
    where = mask_url(url)
    sentinels: list[tuple[str, int]] = []
    username = password = None
    db = None
    query: dict = {}
    for part in (p.strip() for p in url.split(";")):
        if not part:
            continue
        try:
            parsed = urlsplit(part)
            host, port = parsed.hostname, parsed.port or SENTINEL_DEFAULT_PORT
            user, pw = parsed.username, parsed.password
        except ValueError as exc:
            raise _parse_error(url, exc) from None
        if parsed.scheme.lower() != "sentinel":
            raise ValueError(f"invalid Sentinel URL {where}: every ';'-separated part must be sentinel://host:port")
        if not host:
            raise ValueError(f"invalid Sentinel URL {where}: a part has no host")
        sentinels.append((unquote(host), port))
        if username is None and user:
            username = unquote(user)
        if password is None and pw:
            password = unquote(pw)
        path = parsed.path.strip("/")
        if db is None and path:
            try:
                db = int(path)
            except ValueError:
                raise ValueError(f"invalid Sentinel URL {where}: the path must be a database number") from None
        for key, values in parse_qs(parsed.query).items():
            query.setdefault(key, values[0])
    if not sentinels:
        raise ValueError(f"invalid Sentinel URL {where}: no sentinel address")

    master_name = options.get("master_name") or query.pop("master_name", None)
    query.pop("master_name", None)
    if not master_name:
        raise ValueError(
            f"Sentinel URL {where} needs the master's name: set transport option "
            "master_name (e.g. broker_transport_options={'master_name': 'mymaster'}) "
            "or add ?master_name=... to the URL"
        )
    if "db" in query:
        try:
            db = int(query.pop("db"))
        except ValueError:
            raise ValueError(f"invalid Sentinel URL {where}: db must be a number") from None
    url_tls = {k: query.pop(k) for k in list(query) if k in _SSL_KEYS}
    if url_tls:
        want_tls = True  # sentinel:// has no TLS twin scheme; TLS options in the URL ask for it
    tls.update(url_tls)
    if query:
        raise ValueError(f"{where}: unknown query parameter(s) {', '.join(sorted(query))}")

    common = _common_kwargs(socket_timeout, options)
    master_kwargs: dict = dict(common, db=db or 0, socket_keepalive=to_bool(options.get("socket_keepalive", True)))
    if username:
        master_kwargs["username"] = username
    if password:
        master_kwargs["password"] = password
    if want_tls:
        master_kwargs["connection_class"] = SentinelManagedSSLConnection
        master_kwargs.update(_normalise_ssl(tls, where))
    else:
        master_kwargs["connection_class"] = SentinelManagedConnection

    # The sentinels' own connections: the user's sentinel_kwargs (typically their
    # password), but always our time-outs and retry policy.
    sentinel_kwargs = dict(options.get("sentinel_kwargs") or {})
    sentinel_kwargs.update(
        socket_timeout=common["socket_timeout"],
        socket_connect_timeout=common["socket_connect_timeout"],
        retry=_lease_retry(),
    )
    try:
        min_other = int(options.get("min_other_sentinels", 0) or 0)
    except (TypeError, ValueError):
        raise ValueError(f"{where}: min_other_sentinels must be a number") from None
    sentinel = Sentinel(sentinels, min_other_sentinels=min_other, sentinel_kwargs=sentinel_kwargs)
    client = sentinel.master_for(str(master_name), redis_class=SentinelMasterRedis, **master_kwargs)
    client._ccb_sentinel = sentinel
    return client


def _cluster_client(url: str, options: dict, socket_timeout: float, tls: dict, want_tls: bool) -> ClusterClient:
    """A Redis Cluster's lazy client: seed nodes, credentials and options of every ``;``-part."""
    where = mask_url(url)
    nodes: list[tuple[str, int]] = []
    query: dict = {}
    scheme_tls = None
    for part in (p.strip() for p in url.split(";")):
        if not part:
            continue
        scheme, _, rest = part.partition("://")
        if scheme.lower() not in CLUSTER_SCHEMES:
            raise ValueError(f"invalid Redis Cluster URL {where}: every ';'-separated part must be "
                             "redis+cluster://host:port (rediss+cluster:// with TLS)")
        if scheme_tls is not None and CLUSTER_SCHEMES[scheme.lower()] != scheme_tls:
            raise ValueError(f"invalid Redis Cluster URL {where}: mixes redis+cluster:// and rediss+cluster://")
        scheme_tls = CLUSTER_SCHEMES[scheme.lower()]
        plain = ("rediss://" if scheme_tls else "redis://") + rest
        try:
            kwargs = parse_url(plain)
            port = urlsplit(plain).port
        except ValueError as exc:
            raise _parse_error(url, exc) from None
        if kwargs.pop("db", 0) != 0:
            raise ValueError(f"invalid Redis Cluster URL {where}: Redis Cluster has database 0 only")
        host = kwargs.pop("host", None)
        kwargs.pop("port", None)
        kwargs.pop("connection_class", None)
        if not host:
            raise ValueError(f"invalid Redis Cluster URL {where}: a part has no host")
        nodes.append((host, port or CLUSTER_DEFAULT_PORT))
        for key, value in kwargs.items():
            query.setdefault(key, value)
    if not nodes:
        raise ValueError(f"invalid Redis Cluster URL {where}: no node address")
    # The lease's own time-outs and retry policy win over the URL's.
    for key in ("socket_timeout", "socket_connect_timeout", "timeout", "retry_on_timeout", "retry_on_error"):
        query.pop(key, None)
    unknown = sorted(k for k in query if k not in CLUSTER_NODE_KEYS)
    if unknown:
        raise ValueError(f"{where}: query parameter(s) a Redis Cluster client cannot use: "
                         f"{', '.join(unknown)}")
    url_tls = {k: query.pop(k) for k in list(query) if k in _SSL_KEYS}
    if url_tls and not scheme_tls:
        raise ValueError(f"{where}: TLS parameters ({', '.join(sorted(url_tls))}) in the query string need "
                         "a rediss+cluster:// URL")
    tls.update(url_tls)
    common = _common_kwargs(socket_timeout, options)
    # Each node's connections: our time-outs. The cluster client retries (once), not the nodes; redis-py
    # has no per-node health checks (a stale connection fails, the topology is read again, one retry).
    for key in ("retry", "health_check_interval"):
        common.pop(key)
    query.update(common)
    query["socket_keepalive"] = to_bool(options.get("socket_keepalive", True))
    if scheme_tls or want_tls:
        tls = _normalise_ssl(tls, where)
        unsupported = sorted(k for k in tls if k not in CLUSTER_NODE_KEYS)
        if unsupported:
            raise ValueError(f"{where}: TLS option(s) {', '.join(unsupported)} are not supported for a Redis Cluster")
        query["ssl"] = True
        query.update(tls)
    return ClusterClient(nodes, query, where)
