"""A cluster of real ``celery beat`` replicas and a watcher of what reaches the broker.

A watcher thread polls the test's queue on the Redis broker every 50 ms and
remembers every message it ever saw (with the wall time it first saw it), so
"sent twice" and "gap" are read from what reached the broker: the headers say
which occurrence a message is (``cluster_beat_scheduled_at``) and which replica
sent it (``cluster_beat_node`` = ``host:pid``). Shared by the failover and
fault tests; the ``cluster_factory`` fixture lives in conftest.py.
"""
from __future__ import annotations

import json
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable, Dict, List, Optional

import redis

from procs import App, Proc, start_beat, wait_for

UTC = timezone.utc


# ----------------------------------------------------------------------------- observation


@dataclass(frozen=True)
class Seen:
    """One message that reached the broker."""

    tag: str  # kombu's delivery tag: unique per publish, so two sends of one occurrence are two Seen
    schedule: str
    at: datetime  # the occurrence (header cluster_beat_scheduled_at)
    node: str  # the sender (header cluster_beat_node, "host:pid")
    task_id: str
    seen: float  # wall time the watcher first saw it


def _parse_at(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC)


class Watcher:
    """Polls the app's queue (nobody consumes it) and records each message once, when first seen.

    Survives the broker going away (a restart empties a non-persistent Redis: what
    was seen before stays recorded here).
    """

    def __init__(self, app: App, interval: float = 0.05) -> None:
        self.app = app
        self.interval = interval
        self._seen: Dict[str, Seen] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="queue-watcher", daemon=True)
        self._client: Optional[redis.Redis] = None

    def __enter__(self) -> "Watcher":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(5)

    def poll(self) -> None:
        if self._client is None:
            self._client = redis.Redis.from_url(self.app.broker, socket_timeout=1, socket_connect_timeout=0.5)
        try:
            raw = self._client.lrange(self.app.queue, 0, -1)
        except (redis.RedisError, OSError):
            self._client.close()
            self._client = None
            return
        now = time.time()
        with self._lock:
            for item in reversed(raw):  # LPUSH: oldest last
                msg = json.loads(item)
                tag = msg["properties"]["delivery_tag"]
                if tag in self._seen:
                    continue
                h = msg["headers"]
                self._seen[tag] = Seen(tag, h["cluster_beat_schedule"], _parse_at(h["cluster_beat_scheduled_at"]),
                                       h["cluster_beat_node"], h["id"], now)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.poll()
            self._stop.wait(self.interval)
        if self._client is not None:
            self._client.close()

    def messages(self) -> List[Seen]:
        """Every message seen so far, by occurrence then first-seen time."""
        with self._lock:
            return sorted(self._seen.values(), key=lambda m: (m.at, m.seen))

    def wait_for(self, predicate: Callable[[Seen], bool], timeout: float, what: str) -> Seen:
        """The first message (by occurrence) matching *predicate*, waiting up to *timeout* s for one."""
        found: List[Seen] = []

        def check() -> bool:
            found[:] = [m for m in self.messages() if predicate(m)]
            return bool(found)

        wait_for(check, timeout, interval=0.05, what=what)
        return found[0]


def duplicates(messages: List[Seen]) -> Dict[tuple, List[str]]:
    """Occurrences that reached the broker more than once, with who sent each copy."""
    count = Counter((m.schedule, m.at) for m in messages)
    return {k: [m.node for m in messages if (m.schedule, m.at) == k] for k, n in count.items() if n > 1}


def timeline(messages: List[Seen]) -> str:
    """Readable message list for assertion failures."""
    return "\n".join(f"  {m.at:%H:%M:%S.%f} from {m.node} seen {m.seen:.3f}" for m in messages)


# ----------------------------------------------------------------------------- the cluster


def node_pid(node: str) -> int:
    return int(node.rsplit(":", 1)[1])


class Cluster:
    """The beat replicas of one test, looked up by the node id they put in the headers."""

    def __init__(self, app: App, tmp: Path, watcher: Watcher) -> None:
        self.app = app
        self.tmp = tmp
        self.watcher = watcher
        self.procs: List[Proc] = []

    def start(self, n: int, *extra: str, scheduler: Optional[str] = None, env: Optional[dict] = None) -> None:
        for _ in range(n):
            label = f"b{len(self.procs)}"
            if scheduler is None:
                self.procs.append(start_beat(self.app, self.tmp, label, *extra, env=env))
            else:  # a subclass defined in the app module
                args = [sys.executable, "-m", "celery", "-A", self.app.module, "beat", "-S", scheduler,
                        "-l", "info", "--pidfile=", "-s", str(self.tmp / f"unused-{label}"), *extra]
                self.procs.append(Proc(args, cwd=self.app.directory, env=self.app.env(**(env or {})),
                                       log=self.tmp / f"beat-{label}.log"))

    def proc(self, node: str) -> Proc:
        pid = node_pid(node)
        for p in self.procs:
            if p.pid == pid:
                return p
        raise AssertionError(f"no replica of this test has node id {node!r}")

    def steady_leader(self, runs: int = 3, timeout: float = 60.0) -> str:
        """Wait until one node has sent the last *runs* occurrences, the latest within 1.5 s; its node id."""
        leader: List[str] = []

        def check() -> bool:
            msgs = [m for m in self.watcher.messages()]
            tail = msgs[-runs:]
            if len(tail) < runs or len({m.node for m in tail}) != 1 or time.time() - tail[-1].seen > 1.5:
                return False
            leader[:] = [tail[-1].node]
            return True

        wait_for(check, timeout, interval=0.1, what=f"one replica sending {runs} occurrences in a row")
        return leader[0]

    def stop_all(self) -> None:
        for p in self.procs:
            p.stop()

    def logs(self) -> str:
        return "\n".join(f"----- {p.log_path.name} (pid {p.pid})\n{p.log()[-4000:]}" for p in self.procs)




def claim_rows(db_url: str, schedule: str = "tick"):
    """Every claim row of *schedule*, read by a store of the test's own."""
    from celery_cluster_beat.store import ClaimStore

    store = ClaimStore(db_url, node_id="test-reader")
    store.open()
    try:
        return store.claims(schedule)
    finally:
        store.close()


def kill_env(arm_dir) -> dict:
    """Replicas that SIGKILL themselves at the fault point ``after-mark`` once a test arms it for them."""
    return {"CCB_FAULTS": "after-mark=kill", "CCB_FAULT_ARM_DIR": str(arm_dir)}


def kill_after_its_next_mark(arm_dir, proc) -> float:
    """SIGKILL *proc* (started with :func:`kill_env`) at a named point: right after the rows of a
    chunk it published are marked sent, so it dies with nothing on its way to the broker and the
    next second not yet claimed ahead (that claim comes half a second later), however loaded the
    machine; a kill at a wall-clock moment can land between the flush and the mark, and the
    same-id resend the contract allows there would look like a duplicate. Returns once it is dead
    (epoch time)."""
    (Path(arm_dir) / f"after-mark-{proc.pid}").touch()
    proc.popen.wait(20)
    return time.time()


def period_due_soon(minimum: int, lead: float, spread: float = 0.5) -> int:
    """A period P (whole seconds, ``minimum <= P <= minimum * (1 + spread)``) whose ``every(P)``
    grid (the instants k * P since the epoch) has its next instant soonest after now + *lead*.

    A fault test with a sparse schedule (nothing else due for ``minimum`` seconds) plays its
    scene at the first burst after the replicas are up; with a fixed period that burst is
    ``period / 2`` away on average (30 s for ``every(60)``). Choosing among the periods at least
    as sparse puts it about *lead* seconds after the start, without making any gap shorter.
    A start-up slower than *lead* only costs one more period (the tests wait on conditions)."""
    start = time.time() + lead
    return min(range(minimum, int(minimum * (1 + spread)) + 1),
               key=lambda p: (int(start // p) + 1) * p - start)
