"""A loopback TCP proxy that one replica talks to its database or Redis through,
so a test can break that replica's link alone.

Modes:

* ``forward``: bytes pass both ways;
* ``cut()``: every connection is reset and new ones are refused (a partition
  that the client notices at once);
* ``hang()``: connections stay open but nothing passes, new ones are accepted and
  left silent (a partition the client only notices through its time-outs);
* ``drop_replies()``: what the client sends still reaches the server, but the
  server's answers are thrown away (a commit whose reply is lost).

``restore()`` goes back to forwarding for new connections. Threads only, loopback
only, and every socket is closed by :meth:`close`.
"""
from __future__ import annotations

import select
import socket
import struct
import threading
from typing import List, Optional, Tuple


class TcpProxy:
    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self.mode = "forward"
        self._lock = threading.Lock()
        self._pairs: List[Tuple[socket.socket, Optional[socket.socket]]] = []
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name=f"proxy-{self.port}", daemon=True)
        self._thread.start()

    # -- control -------------------------------------------------------------
    def url_for(self, url: str, port: int) -> str:
        """*url* with the target's host:port replaced by the proxy's."""
        return url.replace(f"127.0.0.1:{port}", f"127.0.0.1:{self.port}").replace(f"localhost:{port}", f"127.0.0.1:{self.port}")

    def cut(self) -> None:
        self.mode = "cut"
        self._reset_all()

    def hang(self) -> None:
        self.mode = "hang"

    def drop_replies(self) -> None:
        self.mode = "drop_replies"

    def restore(self) -> None:
        self.mode = "forward"

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.close()
        except OSError:
            pass
        self._reset_all()
        self._thread.join(5)

    def __enter__(self) -> "TcpProxy":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- plumbing ---------------------------------------------------------------
    def _reset_all(self) -> None:
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for sock in pair:
                if sock is not None:
                    _reset(sock)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                readable, _, _ = select.select([self._listener], [], [], 0.2)
                if not readable:
                    continue
                client, _ = self._listener.accept()
            except OSError:
                return
            if self.mode == "cut":
                _reset(client)
                continue
            upstream = None
            if self.mode != "hang":
                try:
                    upstream = socket.create_connection(self.target, timeout=5)
                except OSError:
                    _reset(client)
                    continue
            with self._lock:
                self._pairs.append((client, upstream))
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, client: socket.socket, upstream: Optional[socket.socket]) -> None:
        socks = [client] + ([upstream] if upstream is not None else [])
        try:
            while not self._closed:
                try:
                    readable, _, _ = select.select(socks, [], [], 0.2)
                except (OSError, ValueError):
                    return
                for sock in readable:
                    try:
                        data = sock.recv(65536)
                    except OSError:
                        return
                    if not data:
                        return
                    if self.mode in ("hang", "cut") or upstream is None:
                        continue  # swallowed: nothing passes
                    if sock is upstream and self.mode == "drop_replies":
                        continue
                    other = upstream if sock is client else client
                    try:
                        other.sendall(data)
                    except OSError:
                        return
        finally:
            for sock in socks:
                _reset(sock)


def _reset(sock: socket.socket) -> None:
    """Close with RST (SO_LINGER 0), as a broken network path looks to the peer."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    try:
        sock.close()
    except OSError:
        pass
