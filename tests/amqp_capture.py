"""Reading what reached a RabbitMQ broker, as it is on the wire, for the RabbitMQ tests.

The Redis tests read kombu's JSON envelope from a list; on RabbitMQ a message is an
AMQP content header (properties, application headers) plus body bytes, routed by an
exchange and routing key. :class:`Capture` takes messages off a queue with py-amqp's
``basic_get`` (``auto_decode`` off: the body stays the bytes that were sent) and turns
each into an :class:`Envelope` that compares everything the publisher chose: the body
bytes, every property in wire order with its Python type (``True`` is not ``1``,
``90.0`` is not ``90``), the content header as py-amqp serialises it, and the exchange
and routing key it was published to. Only what the broker assigns per delivery
(``delivery_tag``, ``message_count``) is left out.

:class:`AmqpWatcher` is the failover tests' :class:`cluster.Watcher` for a RabbitMQ
broker: it consumes the app's queue (``basic_get``, no ack) and records each message.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import amqp
from kombu import Connection

from cluster import Seen, Watcher, _parse_at


def connect(url: str, timeout: float = 2.0) -> amqp.Connection:
    """A py-amqp connection to the vhost of the kombu URL *url*."""
    info = Connection(url)
    conn = amqp.Connection(host=f"{info.hostname or '127.0.0.1'}:{info.port or 5672}", userid=info.userid,
                           password=info.password, virtual_host=info.virtual_host or "/", connect_timeout=timeout)
    conn.connect()
    return conn


@dataclass(frozen=True)
class Envelope:
    """One message as it reached the broker, minus what the broker assigns per delivery."""

    body: bytes
    #: repr of the decoded properties, in wire order (application_headers included): types count.
    properties: str
    #: The content header's property list as py-amqp serialises it.
    frame: bytes
    exchange: str
    routing_key: str
    redelivered: bool
    #: The decoded properties themselves (not compared: ``properties`` and ``frame`` are).
    raw: Dict[str, Any] = field(compare=False, repr=False)

    @property
    def headers(self) -> Dict[str, Any]:
        return self.raw.get("application_headers") or {}

    def diff(self, other: "Envelope") -> str:
        """What differs, for an assertion message."""
        out = []
        for name in ("exchange", "routing_key", "redelivered", "body"):
            if getattr(self, name) != getattr(other, name):
                out.append(f"{name}: {getattr(self, name)!r} != {getattr(other, name)!r}")
        mine, theirs = dict(self.raw), dict(other.raw)
        h1, h2 = mine.pop("application_headers", {}) or {}, theirs.pop("application_headers", {}) or {}
        for key in sorted(set(mine) | set(theirs)):
            if repr(mine.get(key)) != repr(theirs.get(key)):
                out.append(f"property {key}: {mine.get(key)!r} != {theirs.get(key)!r}")
        for key in sorted(set(h1) | set(h2)):
            if repr(h1.get(key)) != repr(h2.get(key)):
                out.append(f"header {key}: {h1.get(key)!r} != {h2.get(key)!r}")
        if list(h1) != list(h2) and not out:
            out.append(f"header order: {list(h1)} != {list(h2)}")
        if not out and self != other:
            out.append(f"content header bytes: {self.frame!r} != {other.frame!r}")
        return "\n".join(out) or "(equal)"


def envelope(msg: amqp.Message) -> Envelope:
    info = msg.delivery_info
    body = msg.body if isinstance(msg.body, bytes) else bytes(msg.body)
    return Envelope(body=body, properties=repr(msg.properties), frame=msg._serialize_properties(),
                    exchange=info.get("exchange", ""), routing_key=info.get("routing_key", ""),
                    redelivered=bool(info.get("redelivered")), raw=dict(msg.properties))


class Capture:
    """Takes messages off queues of one vhost (nobody else consumes them)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.conn = connect(url)
        self.channel = self._channel()

    def _channel(self) -> amqp.Channel:
        channel = amqp.Channel(self.conn, auto_decode=False)
        channel.open()
        return channel

    def declare(self, queue: str, *, bind_to: Optional[str] = None, routing_key: str = "#",
                arguments: Optional[dict] = None) -> None:
        """A classic queue of the test's own, bound to the exchange *bind_to* (which must exist)."""
        self.channel.queue_declare(queue, durable=False, auto_delete=False, arguments=arguments or {})
        if bind_to is not None:
            self.channel.queue_bind(queue, bind_to, routing_key)

    def wait_count(self, queue: str, count: int, timeout: float = 10.0) -> None:
        """Wait until *queue* holds *count* messages (ready, not yet taken)."""
        deadline = time.monotonic() + timeout
        while True:
            held = self.channel.queue_declare(queue, passive=True).message_count
            if held >= count:
                return
            if time.monotonic() >= deadline:
                raise AssertionError(f"{queue} holds {held} messages after {timeout:.0f}s, not {count}")
            time.sleep(0.02)

    def get(self, queue: str) -> List[amqp.Message]:
        """Every message on *queue* now (acknowledged: they are gone afterwards)."""
        out = []
        while True:
            msg = self.channel.basic_get(queue, no_ack=True)
            if msg is None:
                return out
            out.append(msg)

    def drain(self, queue: str, expect: int = 1, timeout: float = 10.0, settle: float = 0.3) -> List[Envelope]:
        """The envelopes on *queue*, waiting up to *timeout* for *expect* of them and then *settle*
        seconds more for any extra one (a publish is asynchronous: it may land a moment later)."""
        got: List[amqp.Message] = []
        deadline = time.monotonic() + timeout
        while len(got) < expect and time.monotonic() < deadline:
            got += self.get(queue)
            if len(got) < expect:
                time.sleep(0.02)
        end = time.monotonic() + settle
        while time.monotonic() < end:
            got += self.get(queue)
            time.sleep(0.05)
        return [envelope(m) for m in got]

    def close(self) -> None:
        try:
            self.conn.close()
        except Exception:  # already gone with the vhost
            self.conn.collect()


class AmqpWatcher(Watcher):
    """:class:`cluster.Watcher` for a RabbitMQ broker: consumes the app's queue and records every
    message once, when first seen (a counter stands in for Redis's per-publish delivery tag:
    each message is taken off the queue once)."""

    def __init__(self, app, interval: float = 0.05) -> None:
        super().__init__(app, interval)
        self._conn: Optional[amqp.Connection] = None
        self._chan: Optional[amqp.Channel] = None
        self._count = itertools.count(1)

    def poll(self) -> None:
        try:
            if self._chan is None or not self._chan.is_open:
                if self._conn is None:
                    self._conn = connect(self.app.broker, timeout=1.0)
                self._chan = self._conn.channel()
            while True:
                msg = self._chan.basic_get(self.app.queue, no_ack=True)
                if msg is None:
                    return
                self._record(msg)
        except amqp.exceptions.NotFound:  # not declared yet (the first publish declares it); the channel is closed
            self._chan = None
        except (OSError, amqp.exceptions.AMQPError):
            self._drop()

    def _record(self, msg: amqp.Message) -> None:
        h = msg.headers or {}
        now = time.time()
        tag = str(next(self._count))
        with self._lock:
            self._seen[tag] = Seen(tag, h["cluster_beat_schedule"], _parse_at(h["cluster_beat_scheduled_at"]),
                                   h["cluster_beat_node"], h["id"], now)

    def _drop(self) -> None:
        if self._conn is not None:
            try:
                self._conn.collect()
            except Exception:  # best effort: it is being replaced
                pass
        self._conn = self._chan = None

    def __exit__(self, *exc) -> None:
        super().__exit__(*exc)
        if self._conn is not None:
            try:
                self._conn.close()
            except Exception:  # the vhost may be gone already
                self._drop()
