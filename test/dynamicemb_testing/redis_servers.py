"""``redis-server`` processes of a test's own, on loopback ports.

Tests that need one skip with a reason where ``redis-server`` is not installed
(``.ci/run`` installs it, so CI always runs them).
"""

import os
import shutil
import signal
import socket
import subprocess
import time
from typing import Dict, List, Optional

import pytest

REDIS_SERVER = shutil.which("redis-server")
needs_redis = pytest.mark.skipif(REDIS_SERVER is None,
                                 reason="redis-server is not installed (apt-get install redis-server)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_cluster_port() -> int:
    """A free port p whose cluster bus port p + 10000 is free too (below 65536)."""
    for _ in range(1000):
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


class RedisServer:
    """One ``redis-server`` on 127.0.0.1 in ``workdir``.

    Args:
        workdir: its data directory (AOF/RDB files).
        aof: append-only file on (``appendfsync always``: what it acknowledged
            survives a kill -9).
        extra: more ``--option value`` arguments.
    """

    def __init__(self, workdir: str, aof: bool = False, extra: Optional[List[str]] = None,
                 port: Optional[int] = None) -> None:
        self.workdir = workdir
        self.port = port or free_port()
        self.args = [REDIS_SERVER, "--bind", "127.0.0.1", "--port", str(self.port),
                     "--dir", workdir, "--save", "", "--protected-mode", "yes",
                     "--appendonly", "yes" if aof else "no", "--appendfsync", "always",
                     *(extra or [])]
        self.process: Optional[subprocess.Popen] = None
        self.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self, timeout: float = 5.0) -> None:
        self.process = subprocess.Popen(self.args, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, cwd=self.workdir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2) as s:
                    s.sendall(b"PING\r\n")
                    if s.recv(16).startswith(b"+PONG"):
                        return
            except OSError:
                pass
            if self.process.poll() is not None:
                break
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not start in {timeout} s")

    def kill(self) -> None:
        """kill -9: no shutdown, no save."""
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=5)

    def pause(self) -> None:
        os.kill(self.process.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.process.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.kill(self.process.pid, signal.SIGCONT)  # a paused server must run to exit
            self.process.terminate()
            try:
                self.process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(timeout=5)
        self.process = None


class RedisClusterServers:
    """A Redis Cluster of ``2 * primaries`` ``redis-server`` processes on loopback
    ports (``primaries`` primaries with one replica each), made by ``redis-cli
    --cluster create``; ready (``cluster_state:ok``) when the constructor returns.

    Args:
        workdir: a directory of the cluster's own (a subdirectory per node).
        primaries: how many primaries.
        node_timeout_ms: ``cluster-node-timeout``: how long a node may be silent
            before its replica takes over (small: tests wait for failovers).
    """

    def __init__(self, workdir: str, primaries: int = 3, node_timeout_ms: int = 1000) -> None:
        self.servers: List[RedisServer] = []
        try:
            for i in range(2 * primaries):
                d = os.path.join(workdir, f"node{i}")
                os.makedirs(d, exist_ok=True)
                self.servers.append(RedisServer(d, port=free_cluster_port(), extra=[
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(node_timeout_ms)]))
            subprocess.run([shutil.which("redis-cli"), "--cluster", "create",
                            *[s.address for s in self.servers], "--cluster-replicas", "1",
                            "--cluster-yes"], check=True, capture_output=True, timeout=30)
            self.wait_until_ok()
        except BaseException:
            self.stop()
            raise

    @property
    def seeds(self) -> List[str]:
        return [s.address for s in self.servers]

    def cli(self, *args: str, port: Optional[int] = None, timeout: float = 30) -> str:
        """``redis-cli -p <port> <args>``'s output (port: the first live node's)."""
        port = port or next(s.port for s in self.servers
                            if s.process is not None and s.process.poll() is None)
        return subprocess.run([shutil.which("redis-cli"), "-p", str(port), *args], check=True,
                              capture_output=True, text=True, timeout=timeout).stdout

    def wait_until_ok(self, timeout: float = 20.0) -> None:
        """Until every live node says ``cluster_state:ok`` and every replica's link to
        its primary is up (bounded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = [s for s in self.servers if s.process is not None and s.process.poll() is None]
            if all("cluster_state:ok" in self.cli("cluster", "info", port=s.port) for s in live):
                roles = [self.cli("info", "replication", port=s.port) for s in live]
                if all("role:master" in r or "master_link_status:up" in r for r in roles):
                    return
            time.sleep(0.1)
        raise RuntimeError(f"the Redis Cluster was not ok within {timeout} s")

    def primary_ports(self) -> List[int]:
        """Ports of the nodes that are primaries now."""
        lines = self.cli("cluster", "nodes").splitlines()
        return [int(line.split()[1].split("@")[0].rsplit(":", 1)[1]) for line in lines
                if "master" in line.split()[2] and "fail" not in line.split()[2]]

    def primary_ids(self) -> Dict[int, str]:
        """Port -> node id of the nodes that are primaries now."""
        out = {}
        for line in self.cli("cluster", "nodes").splitlines():
            fields = line.split()
            if "master" in fields[2] and "fail" not in fields[2]:
                out[int(fields[1].split("@")[0].rsplit(":", 1)[1])] = fields[0]
        return out

    def reshard(self, slots: int) -> subprocess.Popen:
        """Starts moving ``slots`` slots from one primary to another (``redis-cli
        --cluster reshard``, in the background: training goes on meanwhile)."""
        (src_port, src), (_, dst) = list(self.primary_ids().items())[:2]
        return subprocess.Popen(
            [shutil.which("redis-cli"), "--cluster", "reshard", f"127.0.0.1:{src_port}",
             "--cluster-from", src, "--cluster-to", dst, "--cluster-slots", str(slots),
             "--cluster-yes"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def server_on(self, port: int) -> RedisServer:
        return next(s for s in self.servers if s.port == port)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()
