"""A real Redis Cluster on loopback for the lease tests: three masters, one replica each.

Six ``redis-server --cluster-enabled yes`` processes in a temporary folder, on free
ports (client and cluster-bus port both picked free, so parallel suites do not
collide), joined by ``redis-cli --cluster create ... --cluster-replicas 1``. A test
may SIGKILL the master that holds a slot: its replica is promoted within a few
seconds (``cluster-node-timeout`` is short); :meth:`RedisClusterNodes.heal` brings
the killed node back (it rejoins as a replica) and waits until every node says
``cluster_state:ok`` again, so the next test starts from a whole cluster.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional

import redis

#: Milliseconds before a silent node counts as failing: short, so a replica takes over in seconds.
NODE_TIMEOUT_MS = 1000


class ClusterUnavailable(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _free_ports(n: int) -> List[int]:
    ports: List[int] = []
    while len(ports) < n:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


class RedisClusterNodes:
    """The nodes of one Redis Cluster, by client port."""

    def __init__(self, workdir: Path, masters: int = 3, replicas: int = 1,
                 node_timeout_ms: int = NODE_TIMEOUT_MS, extra_config: Optional[List[str]] = None) -> None:
        for exe in ("redis-server", "redis-cli"):
            if shutil.which(exe) is None:
                raise ClusterUnavailable(f"`{exe}` is not on PATH: install Redis (7.0 or later) to run these tests")
        self.workdir = workdir
        self.masters = masters
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.extra_config = list(extra_config or [])
        n = masters * (1 + replicas)
        both = _free_ports(2 * n)
        self.ports = both[:n]
        self.bus_ports = dict(zip(self.ports, both[n:]))
        self.procs: Dict[int, subprocess.Popen] = {}

    # ------------------------------------------------------------------ addresses

    @property
    def url(self) -> str:
        """The lease URL of this cluster: one seed node (the client discovers the others)."""
        return f"redis+cluster://127.0.0.1:{self.ports[0]}"

    @property
    def seeds_url(self) -> str:
        """The lease URL naming every node, ``;``-separated."""
        return ";".join(f"redis+cluster://127.0.0.1:{p}" for p in self.ports)

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=1, decode_responses=True)

    def live_ports(self) -> List[int]:
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    # ------------------------------------------------------------------ processes

    def _start_node(self, port: int) -> None:
        folder = self.workdir / f"node-{port}"
        folder.mkdir(parents=True, exist_ok=True)
        args = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                "--cluster-port", str(self.bus_ports[port]), "--cluster-config-file", f"nodes-{port}.conf",
                "--cluster-node-timeout", str(self.node_timeout_ms), "--save", "", "--appendonly", "no",
                # a replica may take over however stale, and syncs at once (not after 5 s)
                "--cluster-replica-validity-factor", "0", "--repl-diskless-sync-delay", "0",
                "--dir", str(folder), "--logfile", str(folder / "redis.log"), *self.extra_config]
        self.procs[port] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        self._wait(lambda: self._ping(port), 10, f"redis-server on port {port}")

    def _ping(self, port: int) -> bool:
        client = self.node(port)
        try:
            return bool(client.ping())
        except (redis.RedisError, OSError):
            return False
        finally:
            client.close()

    @staticmethod
    def _wait(predicate, timeout: float, what: str, interval: float = 0.05) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return
            time.sleep(interval)
        raise ClusterUnavailable(f"timed out after {timeout:.0f}s waiting for {what}")

    def start(self, timeout: float = 60.0) -> None:
        for port in self.ports:
            self._start_node(port)
        cmd = ["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
               "--cluster-replicas", str(self.replicas), "--cluster-yes"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            raise ClusterUnavailable(f"`{' '.join(cmd)}` failed: {done.stdout[-2000:]} {done.stderr[-2000:]}")
        self.wait_ok(timeout)

    def _state_ok(self, port: int) -> bool:
        client = self.node(port)
        try:
            info = client.execute_command("CLUSTER INFO")  # redis-py parses it into a dict
            state = info.get("cluster_state") if isinstance(info, dict) else None
            if not (state == "ok" or "cluster_state:ok" in str(info)):
                return False
            # A replica that never finished its first sync cannot take over: wait for the link.
            replication = client.info("replication")
            return replication.get("role") == "master" or replication.get("master_link_status") == "up"
        except (redis.RedisError, OSError):
            return False
        finally:
            client.close()

    def _masters_view(self, port: int) -> Optional[frozenset]:
        client = self.node(port)
        try:
            slots = client.execute_command("CLUSTER SLOTS")
        except (redis.RedisError, OSError):
            return None
        finally:
            client.close()
        return frozenset((int(s[0]), int(s[1]), int(s[2][1])) for s in slots)

    def wait_ok(self, timeout: float = 60.0) -> None:
        """Until every live node says ``cluster_state:ok``, all agree on the slots' masters, those are up,
        and every replica's link to its master is up (so that it can take over)."""

        def ok() -> bool:
            live = self.live_ports()
            if not all(self._state_ok(p) for p in live):
                return False
            views = {self._masters_view(p) for p in live}
            if len(views) != 1 or None in views:
                return False
            view = next(iter(views))
            covered = sum(end - start + 1 for start, end, _ in view)
            return covered == 16384 and all(master in live for _, _, master in view)

        self._wait(ok, timeout, "cluster_state:ok on every node", interval=0.1)

    def master_of(self, key: str) -> int:
        """The port of the master that serves *key*'s slot, as the live nodes see it."""
        for port in self.live_ports():
            client = self.node(port)
            try:
                slot = int(client.execute_command("CLUSTER KEYSLOT", key))
                for start, end, master, *_ in client.execute_command("CLUSTER SLOTS"):
                    if int(start) <= slot <= int(end):
                        return int(master[1])
            except (redis.RedisError, OSError):
                continue
            finally:
                client.close()
        raise ClusterUnavailable(f"no live node knows the master of {key!r}")

    def replica_of(self, master: int) -> int:
        """The port of a replica of *master*, as the live nodes see it."""
        for port in self.live_ports():
            client = self.node(port)
            try:
                for _start, _end, owner, *replicas in client.execute_command("CLUSTER SLOTS"):
                    if int(owner[1]) == master and replicas:
                        return int(replicas[0][1])
            except (redis.RedisError, OSError):
                continue
            finally:
                client.close()
        raise ClusterUnavailable(f"no live node knows a replica of {master}")

    def kill(self, port: int) -> None:
        """SIGKILL one node (its data and sockets are gone at once)."""
        proc = self.procs[port]
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(5)

    def heal(self, timeout: float = 60.0) -> None:
        """Restart every killed node (it rejoins as a replica) and wait for a whole, agreeing cluster."""
        for port, proc in list(self.procs.items()):
            if proc.poll() is not None:
                self._start_node(port)
        self.wait_ok(timeout)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(5)
