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
from typing import List, Optional

import pytest

REDIS_SERVER = shutil.which("redis-server")
needs_redis = pytest.mark.skipif(REDIS_SERVER is None,
                                 reason="redis-server is not installed (apt-get install redis-server)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One ``redis-server`` on 127.0.0.1 in ``workdir``.

    Args:
        workdir: its data directory (AOF/RDB files).
        aof: append-only file on (``appendfsync always``: what it acknowledged
            survives a kill -9).
        extra: more ``--option value`` arguments.
    """

    def __init__(self, workdir: str, aof: bool = False, extra: Optional[List[str]] = None) -> None:
        self.workdir = workdir
        self.port = free_port()
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
