"""A bounded HTTP/1.1 server for beat's operator surfaces (:mod:`.http` holds the routes).

It shares a process with the scheduling loop, so what an outsider sends must not cost
that process more than a fixed amount, whatever they send:

* **One selector thread** holds every open connection, reads request heads without
  blocking and enforces the deadlines; a request is handed to a **fixed pool** of
  worker threads only once its head (and a small body) is complete, so slow or idle
  clients never occupy a worker. Requests the caller marks *inline* (``/healthz``:
  tiny and cheap) are answered by the selector thread itself and never queue behind
  a slow page.
* **A connection cap**: at the cap, a new connection takes the place of the one that
  has waited longest without a complete request (idle keep-alive, slow or silent
  clients). Open file descriptors therefore stay at the cap plus four.
* **Room for the probe**: at most the cap less ``INLINE_RESERVE`` connections wait on
  the pool (queued or being served); a pool request beyond that is answered ``503``
  at once by the selector thread. However slow a page build (it may wait
  ``db_timeout`` on the database) and however many clients load it, some connections
  are therefore always free to evict for ``/healthz``, and a liveness probe never
  finds the door shut.
* **Deadlines**: a request head must be complete within ``read_timeout`` of its first
  byte (of the accept, for the first request), a keep-alive connection may idle
  ``idle_timeout`` between requests, a response must be taken within ``write_timeout``.
* A client that drops is one DEBUG line, never a traceback; connections closed at the
  cap are summed into one WARNING a minute at most.
"""
from __future__ import annotations

import logging
import queue
import selectors
import socket
import threading
import time
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from email.utils import formatdate
from http import HTTPStatus
from typing import Callable, Deque, Dict, List, Optional, Tuple

logger = logging.getLogger("celery_cluster_beat")

__all__ = ["Limits", "Request", "Response", "BoundedHTTPServer"]

#: At most one "connections closed at the cap" warning per this many seconds.
CAP_WARNING_EVERY = 60.0
#: Connections kept from pool work for inline requests (``/healthz``): see the module docstring.
INLINE_RESERVE = 8
#: Deadlines are checked this often (seconds).
SWEEP_EVERY = 0.25
_HEAD_ENDS = (b"\r\n\r\n", b"\n\n")
_MAX_HEADERS = 100


@dataclass(frozen=True)
class Limits:
    """The bounds (see the module docstring); the defaults suit a status page, a scraper and probes."""

    max_connections: int = 128
    workers: int = 4
    read_timeout: float = 10.0
    idle_timeout: float = 15.0
    write_timeout: float = 10.0
    backlog: int = 512
    max_head: int = 16 * 1024
    max_body: int = 64 * 1024


@dataclass
class Request:
    method: str
    target: str
    version: str
    headers: Dict[str, str]
    keep_alive: bool
    #: The (small, bounded: ``Limits.max_body``) body that came with the request.
    body: bytes = b""

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]


@dataclass
class Response:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"
    headers: Dict[str, str] = field(default_factory=dict)
    close: bool = False


class _BadRequest(Exception):
    def __init__(self, status: int, text: str) -> None:
        super().__init__(text)
        self.status = status


class _Conn:
    __slots__ = ("sock", "peer", "buf", "deadline", "busy")

    def __init__(self, sock: socket.socket, peer: str, deadline: float) -> None:
        self.sock, self.peer, self.buf, self.deadline, self.busy = sock, peer, bytearray(), deadline, False


def _peer(addr: object) -> str:
    return f"{addr[0]}:{addr[1]}" if isinstance(addr, tuple) and len(addr) >= 2 else str(addr)


def parse_head(head: bytes) -> Request:
    """The request line and headers (``_BadRequest`` for anything malformed)."""
    lines = head.decode("latin-1").split("\n")
    parts = lines[0].rstrip("\r").split(" ")
    if len(parts) != 3 or not parts[0].isalpha() or not parts[1]:
        raise _BadRequest(400, "bad request line")
    method, target, version = parts
    if version not in ("HTTP/1.0", "HTTP/1.1"):
        raise _BadRequest(505, "HTTP/1.0 and HTTP/1.1 only")
    headers: Dict[str, str] = {}
    for line in lines[1:]:
        line = line.rstrip("\r")
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or line[0] in " \t":
            raise _BadRequest(400, "bad header line")
        if len(headers) >= _MAX_HEADERS:
            raise _BadRequest(431, "too many headers")
        key = name.lower()
        headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
    tokens = {t.strip().lower() for t in headers.get("connection", "").split(",")}
    keep = "keep-alive" in tokens if version == "HTTP/1.0" else "close" not in tokens
    return Request(method=method, target=target, version=version, headers=headers, keep_alive=keep)


def render(req: Optional[Request], resp: Response, head: bool = False) -> Tuple[bytes, bool]:
    """The response's bytes, and whether the connection stays open after it."""
    keep = req is not None and req.keep_alive and not resp.close
    try:
        reason = HTTPStatus(resp.status).phrase
    except ValueError:
        reason = "Status"
    lines = [f"HTTP/1.1 {resp.status} {reason}", "Server: celery-cluster-beat",
             f"Date: {formatdate(usegmt=True)}", f"Content-Type: {resp.content_type}",
             f"Content-Length: {len(resp.body)}"]
    lines += [f"{k}: {v}" for k, v in resp.headers.items()]
    lines.append("Connection: keep-alive" if keep else "Connection: close")
    data = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return (data if head else data + resp.body), keep


class BoundedHTTPServer:
    """Serves *handler* (a :class:`Request` to a :class:`Response`, on a pool thread) and, for
    requests *inline* says yes to, *handler* on the selector thread (keep those cheap)."""

    def __init__(self, host: str, port: int, handler: Callable[[Request], Response], *,
                 inline: Callable[[Request], bool] = lambda req: False, limits: Limits = Limits(),
                 name: str = "cluster-beat-http") -> None:
        self.host, self.port, self.limits, self.name = host, port, limits, name
        self._handler, self._inline = handler, inline
        self._conns: Dict[_Conn, None] = {}
        self._waiting: "OrderedDict[_Conn, None]" = OrderedDict()  # not being served, longest-waiting first
        self._returned: Deque[Tuple[_Conn, bool]] = deque()
        self._jobs: "queue.Queue[Optional[Tuple[_Conn, Request]]]" = queue.Queue()
        self._threads: List[threading.Thread] = []
        self._stopping = threading.Event()
        self._sel: Optional[selectors.BaseSelector] = None
        self._listener: Optional[socket.socket] = None
        self._wake_r: Optional[socket.socket] = None
        self._wake_w: Optional[socket.socket] = None
        self._capped = 0
        self._busy = 0  # connections queued for, or being served by, the pool
        self._pool_room = max(1, limits.max_connections - min(INLINE_RESERVE, limits.max_connections // 2))
        self._turned_away = 0  # pool requests answered 503 since the last warning
        self._capped_logged = float("-inf")
        self._accept_paused_until = 0.0

    # -- life ------------------------------------------------------------------
    def start(self) -> "BoundedHTTPServer":
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        listener = socket.socket(family, socket.SOCK_STREAM)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((self.host, self.port))
            listener.listen(self.limits.backlog)
            listener.setblocking(False)
        except OSError:
            listener.close()
            raise
        self.port = listener.getsockname()[1]
        self._listener = listener
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._sel = selectors.DefaultSelector()
        self._sel.register(listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        loop = threading.Thread(target=self._loop, name=self.name, daemon=True)
        self._threads = [loop] + [threading.Thread(target=self._work, name=f"{self.name}-{i}", daemon=True)
                                  for i in range(self.limits.workers)]
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        if self._stopping.is_set() or self._sel is None:
            return
        self._stopping.set()
        self._wake()
        for _ in range(self.limits.workers):
            self._jobs.put(None)
        for t in self._threads:
            t.join(5)

    def open_connections(self) -> int:
        return len(self._conns)

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")  # type: ignore[union-attr]
        except OSError:  # the pipe is full: the loop wakes anyway
            pass

    # -- the selector thread ---------------------------------------------------
    def _loop(self) -> None:
        sel = self._sel
        assert sel is not None
        next_sweep = time.monotonic() + SWEEP_EVERY
        try:
            while not self._stopping.is_set():
                for key, _ in sel.select(max(0.0, next_sweep - time.monotonic())):
                    if key.data == "listen":
                        self._accept()
                    elif key.data == "wake":
                        self._drain_wake()
                    else:
                        self._guarded(key.data)
                self._take_returned()
                now = time.monotonic()
                if now >= next_sweep:
                    self._sweep(now)
                    next_sweep = now + SWEEP_EVERY
        except Exception:  # a bug here must not take beat down; /healthz then stops answering
            logger.exception("cluster-beat http: the server loop failed; the server stops")
        finally:
            self._close_all()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(4096):  # type: ignore[union-attr]
                pass
        except OSError:
            pass

    def _accept(self) -> None:
        now = time.monotonic()
        for _ in range(64):  # a batch; the listener stays readable for the rest
            try:
                sock, addr = self._listener.accept()  # type: ignore[union-attr]
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:  # out of descriptors (EMFILE...): stop accepting for a moment
                logger.warning("cluster-beat http: cannot accept connections: %s", exc)
                self._sel.unregister(self._listener)  # type: ignore[union-attr]
                self._accept_paused_until = now + 1.0
                return
            if len(self._conns) >= self.limits.max_connections:
                self._capped += 1
                victim = next(iter(self._waiting), None)
                if victim is None:
                    _hard_close(sock)
                    continue
                self._close(victim)
            sock.setblocking(False)
            conn = _Conn(sock, _peer(addr), now + self.limits.read_timeout)
            self._conns[conn] = None
            self._waiting[conn] = None
            self._sel.register(sock, selectors.EVENT_READ, conn)  # type: ignore[union-attr]
            self._guarded(conn)  # a request sent with the connect is read before anyone can evict it

    def _guarded(self, conn: _Conn) -> None:
        """:meth:`_readable`, where a bug met by one client's bytes closes that client, not the server."""
        try:
            self._readable(conn)
        except Exception:
            logger.warning("cluster-beat http: a request from %s could not be handled; closed", conn.peer,
                           exc_info=True)
            self._close(conn)

    def _readable(self, conn: _Conn) -> None:
        if conn not in self._conns:  # evicted earlier in this round of events
            return
        try:
            data = conn.sock.recv(65536)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._drop(conn, exc)
            return
        if not data:
            if conn.buf:
                logger.debug("cluster-beat http: %s closed in the middle of a request", conn.peer)
            self._close(conn)
            return
        if not conn.buf:  # the first byte of a request: the head is due within read_timeout (never later)
            conn.deadline = min(conn.deadline, time.monotonic() + self.limits.read_timeout)
        conn.buf += data
        self._next_request(conn)

    def _next_request(self, conn: _Conn) -> None:
        """Answer or hand on each complete request in *conn*'s buffer; refuse a malformed one."""
        while conn in self._conns and not conn.busy:
            buf = conn.buf
            ends = [(i, len(e)) for e in _HEAD_ENDS for i in (buf.find(e, 0, self.limits.max_head + 4),) if i >= 0]
            if not ends:
                if len(buf) > self.limits.max_head:
                    self._answer_inline(conn, None, Response(431, b"request head too large\n", close=True))
                return
            at, size = min(ends)
            try:
                req = parse_head(bytes(buf[:at]))
                length = self._body_length(req)
            except _BadRequest as exc:
                self._answer_inline(conn, None, Response(exc.status, f"{exc}\n".encode(), close=True))
                return
            if len(buf) < at + size + length:
                return  # the (small) body is still on its way
            req.body = bytes(buf[at + size:at + size + length])
            del buf[:at + size + length]
            if self._inline(req):
                self._answer_inline(conn, req, None)
                continue
            if self._busy >= self._pool_room:  # keep the rest of the cap for /healthz
                self._turned_away += 1
                self._answer_inline(conn, req, Response(503, b"busy: try again shortly\n",
                                                        headers={"Retry-After": "1"}, close=True))
                return
            self._busy += 1
            conn.busy = True
            self._waiting.pop(conn, None)
            self._sel.unregister(conn.sock)  # type: ignore[union-attr]
            self._jobs.put((conn, req))
            return

    def _body_length(self, req: Request) -> int:
        if "transfer-encoding" in req.headers:
            raise _BadRequest(411, "a body needs Content-Length")
        text = req.headers.get("content-length", "0")
        if not text.isdigit() or not text.isascii():
            raise _BadRequest(400, "bad Content-Length")
        if len(text) > 12:  # int() of thousands of digits is slow, or refused
            raise _BadRequest(413, "request body too large")
        if int(text) > self.limits.max_body:
            raise _BadRequest(413, "request body too large")
        return int(text)

    def _answer_inline(self, conn: _Conn, req: Optional[Request], resp: Optional[Response]) -> None:
        if resp is None:
            resp = self._call(req)  # type: ignore[arg-type]
        data, keep = render(req, resp, head=req is not None and req.method == "HEAD")
        try:
            sent = conn.sock.send(data)
        except OSError as exc:
            self._drop(conn, exc)
            return
        if sent < len(data) or not keep:  # a client that does not read a few hundred bytes is not waited for
            self._close(conn)
        else:
            self._waits(conn)

    def _waits(self, conn: _Conn) -> None:
        """*conn* waits for its next request (keep-alive): it goes to the end of the eviction order."""
        conn.deadline = time.monotonic() + (self.limits.read_timeout if conn.buf else self.limits.idle_timeout)
        self._waiting.pop(conn, None)
        self._waiting[conn] = None

    def _take_returned(self) -> None:
        while self._returned:
            conn, keep = self._returned.popleft()
            conn.busy = False
            self._busy -= 1
            if not keep or self._stopping.is_set():
                self._close(conn)
                continue
            try:
                self._sel.register(conn.sock, selectors.EVENT_READ, conn)  # type: ignore[union-attr]
            except (ValueError, OSError):
                self._close(conn)
                continue
            self._waits(conn)
            self._next_request(conn)  # one already buffered (pipelined) goes on now

    def _sweep(self, now: float) -> None:
        expired = [c for c in self._waiting if c.deadline <= now]
        for conn in expired:
            logger.debug("cluster-beat http: %s timed out %s", conn.peer,
                         "in the middle of a request" if conn.buf else "waiting for a request")
            self._close(conn)
        if self._accept_paused_until and now >= self._accept_paused_until:
            self._accept_paused_until = 0.0
            self._sel.register(self._listener, selectors.EVENT_READ, "listen")  # type: ignore[union-attr]
        if (self._capped or self._turned_away) and now - self._capped_logged >= CAP_WARNING_EVERY:
            logger.warning("cluster-beat http: %d connection(s) closed at the cap of %d open connections, "
                           "%d request(s) answered 503 with %d waiting on a page or /metrics",
                           self._capped, self.limits.max_connections, self._turned_away, self._pool_room)
            self._capped, self._turned_away, self._capped_logged = 0, 0, now

    def _drop(self, conn: _Conn, exc: BaseException) -> None:
        logger.debug("cluster-beat http: %s dropped: %s", conn.peer, type(exc).__name__)
        self._close(conn)

    def _close(self, conn: _Conn) -> None:
        self._conns.pop(conn, None)
        self._waiting.pop(conn, None)
        if not conn.busy:
            try:
                self._sel.unregister(conn.sock)  # type: ignore[union-attr]
            except (KeyError, ValueError):
                pass
        _hard_close(conn.sock)

    def _close_all(self) -> None:
        for conn in list(self._conns):
            if not conn.busy:
                self._close(conn)
        for sock in (self._listener, self._wake_r, self._wake_w):
            if sock is not None:
                sock.close()
        if self._sel is not None:
            self._sel.close()

    # -- the pool --------------------------------------------------------------
    def _call(self, req: Request) -> Response:
        try:
            return self._handler(req)
        except Exception:  # a broken page must not kill the server thread
            logger.exception("cluster-beat http: %s %s failed", req.method, req.path[:200])
            return Response(500, b"internal error\n")

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            conn, req = job
            data, keep = render(req, self._call(req), head=req.method == "HEAD")
            try:
                conn.sock.settimeout(self.limits.write_timeout)  # the whole sendall, since Python 3.5
                conn.sock.sendall(data)
                conn.sock.setblocking(False)
            except OSError as exc:
                logger.debug("cluster-beat http: %s dropped: %s", conn.peer, type(exc).__name__)
                keep = False
            if self._stopping.is_set():
                self._conns.pop(conn, None)
                _hard_close(conn.sock)
                continue
            self._returned.append((conn, keep))
            self._wake()


def _hard_close(sock: socket.socket) -> None:
    try:
        sock.close()
    except OSError:  # pragma: no cover
        pass
