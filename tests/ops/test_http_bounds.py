"""Beat's HTTP server has bounds: no client, however many, slow or silent, can take it (or beat) down.

* In-process (:class:`OpsServer` on real sockets, fast): the connection cap, the read deadline
  against a slowloris client, the idle deadline of keep-alive, keep-alive and pipelining done
  right, malformed requests answered without a traceback, the bearer token (page and
  ``/metrics`` only, never ``/healthz``) and the ``/healthz``-alone mode, wired from the
  settings as beat does; hypothesis sends whatever bytes it likes (an answer or a close,
  never a 500 or a warning); the page shows names with ``:`` and ``@`` as they are, and a
  megabyte description costs no more than its size.
* A real ``celery beat`` with a token: 2,000 idle connections at once, then all dropped at
  once with a reset: ``/healthz`` keeps answering within seconds, beat's open file
  descriptors stay under the cap plus a margin, and its log has no ERROR and no traceback.
"""
from __future__ import annotations

import http.client
import logging
import os
import resource
import socket
import struct
import threading
import time
from typing import Iterator, List, Optional

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from celery_cluster_beat.ops.http import LoopHealth, OpsServer
from celery_cluster_beat.ops.httpserver import INLINE_RESERVE, Limits
from procs import _free_port, start_beat, wait_for, write_app

TOKEN = "t0ken-for-the-tests-0123456789"


class _Exposition:
    """Stands for the metrics registry: the server only calls ``exposition()``."""

    def exposition(self) -> bytes:
        return b"# HELP x y\n# TYPE x gauge\nx 1.0\n"


@pytest.fixture
def serve() -> Iterator:
    started: List[OpsServer] = []

    def start(*, token: Optional[str] = None, page: bool = True, **limits) -> OpsServer:
        server = OpsServer("127.0.0.1", 0, metrics=_Exposition() if page else None, health=LoopHealth(margin=60),
                           page=(lambda: "<!DOCTYPE html><p>page</p>") if page else None, token=token,
                           limits=Limits(**limits)).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()


def request(server: OpsServer, path: str, headers: Optional[dict] = None, method: str = "GET"):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        conn.request(method, path, headers=headers or {})
        resp = conn.getresponse()
        return resp.status, resp.read(), resp
    finally:
        conn.close()


def raw(server: OpsServer, data: bytes, timeout: float = 10.0) -> bytes:
    """Send *data* on a fresh connection; everything until the server closes it."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while True:
            chunk = s.recv(65536)
            if not chunk:
                return out
            out += chunk


def closed_by_server(sock: socket.socket, within: float) -> bool:
    """Whether the server closes *sock* within *within* seconds (reading whatever comes first)."""
    sock.settimeout(within)
    try:
        while sock.recv(4096):
            pass
        return True
    except ConnectionResetError:
        return True
    except socket.timeout:
        return False


def own_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# ----------------------------------------------------------------------------- in-process


@pytest.mark.timeout(30)
def test_token_is_required_for_the_page_and_metrics_but_never_for_healthz(serve):
    server = serve(token=TOKEN)
    for path in ("/", "/index.html", "/metrics"):
        status, body, resp = request(server, path)
        assert status == 401, (path, body)
        assert resp.getheader("WWW-Authenticate", "").startswith("Bearer")
        assert request(server, path, {"Authorization": "Bearer wrong-token-0123456789"})[0] == 401
        assert request(server, path, {"Authorization": f"Basic {TOKEN}"})[0] == 401
        assert request(server, path, {"Authorization": f"Bearer {TOKEN}x"})[0] == 401
        assert request(server, path, {"Authorization": f"Bearer {TOKEN}"})[0] == 200
    assert request(server, "/metrics", {"Authorization": f"bearer {TOKEN}"})[1].startswith(b"# HELP")
    assert request(server, "/healthz")[0] == 200  # a probe carries no secret
    assert request(server, "/nothing-here", {"Authorization": f"Bearer {TOKEN}"})[0] == 404
    assert request(server, "/", method="POST")[0] == 405  # read-only before anything else


@pytest.mark.timeout(30)
def test_page_off_serves_healthz_alone(serve):
    server = serve(page=False)
    status, body, _ = request(server, "/healthz")
    assert status == 200 and body.startswith(b"ok: last tick")
    for path in ("/", "/index.html", "/metrics", "/x"):
        status, body, _ = request(server, path)
        assert status == 404 and b"/metrics" not in body, (path, body)


@pytest.mark.timeout(30)
def test_keep_alive_pipelining_and_http_1_0_are_handled(serve):
    server = serve()
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        for path in ("/healthz", "/", "/metrics", "/healthz", "/"):  # one connection, inline and pooled
            conn.request("GET", path)
            resp = conn.getresponse()
            assert resp.status == 200 and resp.getheader("Connection") == "keep-alive"
            resp.read()
        assert server.open_connections() == 1
    finally:
        conn.close()
    # three requests in one write: three answers, in order, the last one closing
    three = (b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nHEAD / HTTP/1.1\r\nHost: x\r\n\r\n"
             b"GET /metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    out = raw(server, three)
    assert out.count(b"HTTP/1.1 200 OK") == 3
    assert out.index(b"ok: last tick") < out.index(b"# HELP x y")
    assert b"<p>page</p>" not in out  # HEAD: headers only
    # HTTP/1.0 without keep-alive: answered, then closed
    out = raw(server, b"GET /healthz HTTP/1.0\r\n\r\n")
    assert out.startswith(b"HTTP/1.1 200 OK") and b"Connection: close" in out


@pytest.mark.timeout(30)
def test_malformed_requests_get_an_error_and_no_traceback(serve, caplog):
    server = serve(max_head=2048)
    caplog.set_level(logging.DEBUG, logger="celery_cluster_beat")
    cases = {
        b"garbage\r\n\r\n": b"400",
        b"GET / HTTP/2.0\r\n\r\n": b"505",
        b"GET / HTTP/1.1\r\n bad: fold\r\n\r\n": b"400",
        b"GET / HTTP/1.1\r\nX: " + b"a" * 4000 + b"\r\n\r\n": b"431",
        b"POST / HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n": b"413",
        b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n": b"411",
        b"POST / HTTP/1.1\r\nContent-Length: " + b"9" * 1000 + b"\r\n\r\n": b"413",
        b"GET / HTTP/1.1\r\nContent-Length: -1\r\n\r\n": b"400",
        b"POST / HTTP/1.1\r\nContent-Length: 3\r\nConnection: close\r\n\r\nx=1": b"405",  # body read
    }
    for data, code in cases.items():
        assert raw(server, data).startswith(b"HTTP/1.1 " + code), data
    assert request(server, "/healthz")[0] == 200
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info], caplog.text


@pytest.mark.timeout(30)
def test_a_slowloris_client_is_cut_after_the_read_timeout_and_healthz_answers_meanwhile(serve):
    server = serve(read_timeout=2.0, idle_timeout=60.0)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as slow:
        started = time.monotonic()
        cut: Optional[float] = None
        for ch in b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 30:
            try:
                slow.sendall(bytes([ch]))
            except OSError:
                cut = time.monotonic() - started
                break
            if closed_by_server(slow, within=1.0):  # a byte a second
                cut = time.monotonic() - started
                break
            assert request(server, "/healthz")[0] == 200
        assert cut is not None, "the slow client was never cut"
        assert 1.5 <= cut <= 8.0, cut  # the read timeout is 2 s; generous above for a loaded machine


@pytest.mark.timeout(30)
def test_an_idle_keep_alive_connection_is_closed_after_the_idle_timeout(serve):
    server = serve(idle_timeout=1.5)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
        s.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        first = s.recv(4096)
        assert first.startswith(b"HTTP/1.1 200")
        assert closed_by_server(s, within=10.0)
    wait_for(lambda: server.open_connections() == 0, 5, what="the idle connection forgotten")


@pytest.mark.timeout(30)
def test_connections_over_the_cap_are_closed_at_once_and_healthz_still_answers(serve):
    cap = 20
    server = serve(max_connections=cap, read_timeout=60.0)
    before = own_fds()
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=10) for _ in range(cap * 5)]
    try:
        wait_for(lambda: server.open_connections() >= cap, 10, what="the server holding the cap")
        time.sleep(0.5)  # the loop has accepted what it will
        assert server.open_connections() <= cap
        # the process holds our client sockets too: the server's side adds at most the cap
        assert own_fds() - before <= len(socks) + cap + 2, (own_fds(), before)
        t0 = time.monotonic()
        assert request(server, "/healthz")[0] == 200
        assert time.monotonic() - t0 < 5
        closed = sum(closed_by_server(s, within=0.05) for s in socks)
        assert closed >= len(socks) - cap - 1  # at least every one over the cap
    finally:
        for s in socks:
            s.close()
    wait_for(lambda: server.open_connections() == 0, 10, what="the closed connections forgotten")


@pytest.mark.timeout(60)
def test_healthz_answers_while_a_slow_page_build_holds_every_connection_it_may(serve):
    """A page build waiting on the database (up to db_timeout, under the page lock) with cap-many
    loads queued behind it: the pool takes at most the cap less a reserve, the rest are told 503
    at once, and /healthz still gets a connection and its 200 (a liveness probe must not restart beat)."""
    release = threading.Event()

    def slow_page() -> str:
        release.wait(30)
        return "<!DOCTYPE html><p>page</p>"

    server = OpsServer("127.0.0.1", 0, health=LoopHealth(margin=60), page=slow_page).start()
    cap = server.limits.max_connections
    socks = [socket.create_connection(("127.0.0.1", server.port), timeout=20) for _ in range(cap)]
    try:
        for s in socks:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        # the loads over the pool's share are answered 503 at once, without waiting on the page
        answers: dict = {}
        deadline = time.monotonic() + 15
        while len(answers) < INLINE_RESERVE and time.monotonic() < deadline:
            for i, s in enumerate(socks):
                if i not in answers:
                    s.settimeout(0.02)
                    try:
                        answers[i] = s.recv(4096)
                    except socket.timeout:
                        pass
        assert len(answers) == INLINE_RESERVE, answers
        assert all(a.startswith(b"HTTP/1.1 503") for a in answers.values()), answers
        for _ in range(3):
            t0 = time.monotonic()
            status, body, _ = request(server, "/healthz")
            assert status == 200, body
            assert time.monotonic() - t0 < 5
        assert not release.is_set()  # the page build is still held: the probe did not wait on it
        release.set()
        for i, s in enumerate(socks):  # the others all get the page once it is built
            if i not in answers:
                s.settimeout(20)
                assert s.recv(4096).startswith(b"HTTP/1.1 200")
    finally:
        release.set()
        for s in socks:
            s.close()
        server.stop()


# ----------------------------------------------------------------------------- a real beat

CONF = """{
    'cluster_beat_lock_ttl': 2,
    'cluster_beat_http_port': int(os.environ['CCB_TEST_HTTP_PORT']),
    'cluster_beat_http_token': os.environ['CCB_TEST_HTTP_TOKEN'],
}"""
IDLE = 2000
#: The server's default cap (Limits.max_connections) and what beat holds besides its connections.
CAP, MARGIN = Limits().max_connections, 60


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _served(pid: int, port: int) -> int:
    """Connections to *port* that process *pid* holds a descriptor of (the listener excluded)."""
    with open("/proc/net/tcp") as f:
        rows = [line.split() for line in f.readlines()[1:]]
    on_port = {r[9] for r in rows if int(r[1].split(":")[1], 16) == port and r[3] != "0A"}
    held = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            held.add(target[8:-1])
    return len(on_port & held)


def _healthz(port: int, timeout: float = 5.0) -> Optional[int]:
    try:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
        conn.request("GET", "/healthz")
        status = conn.getresponse().status
        conn.close()
        return status
    except OSError as exc:
        print(f"/healthz: {exc!r}")
        return None


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_real_beat_survives_2000_idle_connections_and_their_reset(tmp_path, redis_url, pg_url):
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < IDLE + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, IDLE + 1000), hard))
    port = _free_port()
    app = write_app(tmp_path, broker=redis_url, db_url=pg_url, redis_url=None, conf=CONF,
                    schedule="{'tick': {'task': 't.record', 'schedule': every(1)}}")
    proc = start_beat(app, tmp_path, "b0", env={"CCB_TEST_HTTP_PORT": str(port), "CCB_TEST_HTTP_TOKEN": TOKEN})
    socks: List[socket.socket] = []
    try:
        wait_for(lambda: _healthz(port, 1.0) == 200, 60, what="beat's /healthz answering")
        wait_for(lambda: "the page and /metrics need the bearer token" in proc.log(), 10,
                 what="beat logging that the page needs the token")  # logged just after /healthz answers
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("GET", "/metrics")
        assert conn.getresponse().status == 401
        conn.close()
        baseline = _fds(proc.pid)

        def flood() -> None:
            for _ in range(IDLE):
                try:
                    socks.append(socket.create_connection(("127.0.0.1", port), timeout=5))
                except OSError:  # the backlog overflowing is the client's problem, not beat's
                    pass

        opener = threading.Thread(target=flood)
        opener.start()
        worst = 0.0
        while opener.is_alive() or worst == 0.0:  # probe while the flood goes on, and once after
            t0 = time.monotonic()
            # As Kubernetes probes (failureThreshold 3): one probe may lose its connection to the
            # flood (on a loaded machine the flooding thread can hold this process's GIL between
            # the probe's connect and its request, and the flood evicts it meanwhile); three in a
            # row may not.
            answers = []
            for _ in range(3):
                answers.append(_healthz(port, timeout=10))
                if answers[-1] == 200:
                    break
            assert answers[-1] == 200, (answers, proc.log()[-3000:])
            worst = max(worst, time.monotonic() - t0)
            assert _fds(proc.pid) <= baseline + CAP + MARGIN, (_fds(proc.pid), baseline)
            assert _served(proc.pid, port) <= CAP + 1  # the probe's own may come on top
            time.sleep(0.2)
        opener.join()
        assert len(socks) > CAP * 2, len(socks)
        assert worst < 30.0, worst  # seconds, not the minutes a stuck server would take (loaded machine: room)
        # every client goes away at once, with a reset (SO_LINGER 0)
        for s in socks:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        socks.clear()
        wait_for(lambda: _healthz(port, 2.0) == 200, 10, what="/healthz after the reset")
        wait_for(lambda: _served(proc.pid, port) == 0, 10, what="beat closing every reset connection")
        assert _fds(proc.pid) <= baseline + MARGIN
        log = proc.log()
        assert "Traceback" not in log and " ERROR" not in log and "CRITICAL" not in log, log[-5000:]
        wait_for(lambda: "Sending due task tick" in proc.log(), 15, what="beat sending its schedule")
    except BaseException:
        print(proc.log()[-5000:])
        raise
    finally:
        for s in socks:
            s.close()
        proc.stop()


@pytest.mark.timeout(60)
def test_the_page_shows_names_as_they_are_and_a_megabyte_description_costs_no_more_than_its_size():
    from celery_cluster_beat.ops.dashboard import DESCRIPTION_SHOWN
    from celery_cluster_beat.ops.http import render_page
    from celery_cluster_beat.ops.pagehtml import MAX_SHOWN

    name = "xss:user:alice@example.com"
    schedules = [{"name": name, "description": "team:billing@corp <b>x</b>"},
                 {"name": "big", "description": ":" * 1_000_000},
                 {"name": "big2", "description": "a:b@" * 250_000}]
    status = {"db_url": "postgresql://u:***@h/db"}
    empty = render_page(title="t", node="n", status=status, schedules=[])
    started = time.perf_counter()
    page = render_page(title="t", node="n", status=status, schedules=schedules)
    took = time.perf_counter() - started
    assert took < 10.0, took  # the old masking took minutes on one such description (CPU-bound: a loaded machine)
    assert f">{name}<" in page and "team:billing@corp &lt;b&gt;x&lt;/b&gt;" in page
    assert "postgresql://u:***@h/db" in page  # shown as read (masked there), escaped, never masked again
    # A cell shows its first characters and counts the rest: the page stays small.
    assert ":" * DESCRIPTION_SHOWN + "… (1,000,000 characters)" in page
    assert len(page) - len(empty) < 20 * MAX_SHOWN, len(page) - len(empty)



class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: List[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture(scope="module")
def fuzz_server() -> Iterator[OpsServer]:
    records = _Records()
    logging.getLogger("celery_cluster_beat").addHandler(records)
    server = OpsServer("127.0.0.1", 0, metrics=_Exposition(), health=LoopHealth(margin=60),
                       page=lambda: "<p>page</p>", token=TOKEN,
                       limits=Limits(read_timeout=1.0, max_head=4096)).start()
    server.records = records.records  # type: ignore[attr-defined]
    yield server
    server.stop()
    logging.getLogger("celery_cluster_beat").removeHandler(records)


_PARTS = st.sampled_from([b"GET", b"HEAD", b"POST", b" ", b"/", b"/healthz", b"/metrics", b"?", b"HTTP/1.1",
                          b"HTTP/1.0", b"\r\n", b"\n", b":", b"Content-Length: ", b"Connection: close",
                          b"Authorization: Bearer ", TOKEN.encode(), b"\x00", b"\xff", b"9", b"-", b"\t"])


@pytest.mark.timeout(120)
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.one_of(st.lists(_PARTS, max_size=40).map(b"".join), st.binary(max_size=600)))
def test_whatever_a_client_sends_the_server_answers_or_closes_and_healthz_still_answers(fuzz_server, data):
    with socket.create_connection(("127.0.0.1", fuzz_server.port), timeout=10) as s:
        s.sendall(data + b"\r\n\r\n")
        s.shutdown(socket.SHUT_WR)
        s.settimeout(10)
        out = b""
        try:
            while True:  # until the server closes: at the latest after its read timeout (1 s)
                chunk = s.recv(65536)
                if not chunk:
                    break
                out += chunk
        except ConnectionResetError:
            pass
    assert out == b"" or out.startswith(b"HTTP/1.1 "), out[:200]
    assert b"500 Internal" not in out
    assert request(fuzz_server, "/healthz")[0] == 200
    bad = [r for r in fuzz_server.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not bad, [r.getMessage() for r in bad]


@pytest.mark.timeout(30)
@pytest.mark.parametrize("page", [False, True])
def test_beat_wires_the_page_and_token_settings_into_its_server(tmp_path, page):
    from celery import Celery

    from celery_cluster_beat.config import load_settings
    from celery_cluster_beat.ops.http import start_beat_server

    app = Celery("http-wiring", broker="memory://")
    app.conf.update(cluster_beat_http_port=0, cluster_beat_http_page=page, cluster_beat_http_token=TOKEN,
                    cluster_beat_db_url=f"sqlite:///{tmp_path}/claims.sqlite3", cluster_beat_redis_url="")
    settings = load_settings(app.conf, has_result_backend=lambda: False)
    ops = start_beat_server(app, settings, sender=object())
    try:
        server = ops.server
        assert request(server, "/healthz")[0] == 200
        assert request(server, "/metrics")[0] == (401 if page else 404)
        assert request(server, "/metrics", {"Authorization": f"Bearer {TOKEN}"})[0] == (200 if page else 404)
        assert request(server, "/", {"Authorization": f"Bearer {TOKEN}"})[0] in ((200, 503) if page else (404,))
    finally:
        ops.stop()


class _FrozenOnce(LoopHealth):
    """A health check that holds the selector thread (which answers /healthz inline) until released:
    as when the whole beat process is stopped for a while (SIGSTOP, a VM paused, a 24 s GC)."""

    def __init__(self) -> None:
        super().__init__(margin=60)
        self.entered, self.release = threading.Event(), threading.Event()

    def check(self):
        if not self.release.is_set():
            self.entered.set()
            self.release.wait(30)
        return super().check()


def _hang_up(port: int, target: bytes, reset: bool) -> None:
    """Send a request and close at once, without reading (with a reset if *reset*)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"GET " + target + b" HTTP/1.1\r\nHost: x\r\n\r\n")
    if reset:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


@pytest.mark.timeout(60)
def test_probes_and_clients_that_hang_up_before_the_answer_are_debug_lines_never_warnings():
    """A probe polling /healthz of a frozen beat gives up and closes (or resets) its connections; when
    the process resumes, writing their answers fails (broken pipe, reset). So does a page's answer to a
    client gone before it was built. Each is one DEBUG line: no WARNING, no traceback."""
    records = _Records()
    log = logging.getLogger("celery_cluster_beat")
    log.addHandler(records)
    old_level = log.level
    log.setLevel(logging.DEBUG)
    health = _FrozenOnce()
    big = "<p>" + "x" * 4_000_000 + "</p>"  # larger than any socket buffer: its write meets the reset

    def page() -> str:
        time.sleep(0.3)  # the client is gone by the time the answer is written
        return big

    server = OpsServer("127.0.0.1", 0, health=health, page=page).start()
    try:
        first = threading.Thread(target=_hang_up, args=(server.port, b"/healthz", False))
        first.start()
        assert health.entered.wait(10)  # the selector thread is now "frozen" inside the probe's answer
        for i in range(20):
            _hang_up(server.port, b"/healthz", reset=i % 2 == 0)
        for i in range(4):
            _hang_up(server.port, b"/", reset=i % 2 == 0)
        health.release.set()  # the process resumes: every answer is written to a closed connection
        first.join(10)
        wait_for(lambda: server.open_connections() == 0 and server.page_builds >= 1, 30,
                 what="every hung-up connection closed")
        time.sleep(0.5)  # a pool thread may still be writing the page
        assert request(server, "/healthz")[0] == 200
    finally:
        server.stop()
        log.removeHandler(records)
        log.setLevel(old_level)
    bad = [r for r in records.records if r.levelno >= logging.WARNING or r.exc_info]
    assert not bad, [(r.levelname, r.getMessage()) for r in bad]
    dropped = [r.getMessage() for r in records.records if r.levelno == logging.DEBUG]
    # the scenario happened: answers were written to connections already gone
    assert any("BrokenPipeError" in m or "ConnectionResetError" in m for m in dropped), dropped
