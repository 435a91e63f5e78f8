"""A real redis-server for tests: free port, temp dir, kill and restart on the same port.

    with RedisServer() as server:          # started
        client = redis.asyncio.Redis.from_url(server.url)
        server.stop()                      # SIGKILL: Redis "crashes" mid-run
        server.start()                     # back on the same port (data kept only with appendonly=True)

Standard library only, so any test package can use it.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """One redis-server process on 127.0.0.1:`port`, its files in a private temp dir."""

    def __init__(self, port: int | None = None, appendonly: bool = False, executable: str = "redis-server") -> None:
        path = shutil.which(executable)
        if path is None:
            raise RuntimeError(f"{executable!r} not found on PATH; install it (make redis) to run these tests")
        self.executable = path
        self.port = port if port is not None else free_port()
        self.appendonly = appendonly
        self.dir = Path(tempfile.mkdtemp(prefix="prefixserve-redis-"))
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start the server (no-op when running) and return once it answers on its port."""
        if self.running:
            return self
        args = [
            self.executable,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--logfile", "redis.log",
            "--daemonize", "no",
            "--protected-mode", "no",
        ]
        self._proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=self.dir)
        deadline = time.monotonic() + timeout_s
        while not self._serving(self._proc.pid):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not start; log:\n{self.log()}")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Kill the server (SIGKILL, like a crash) and wait until it is gone; no-op when stopped."""
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        if proc is not None:
            proc.wait(timeout=10)

    def close(self) -> None:
        """Stop the server and delete its files."""
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    def log(self) -> str:
        path = self.dir / "redis.log"
        return path.read_text(errors="replace") if path.exists() else "(no log)"

    def _serving(self, pid: int) -> bool:
        """True once the server on our port answers and is our process (not a stray one on that port)."""
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as sock:
                sock.sendall(b"INFO server\r\n")
                reply = b""
                while b"process_id:" not in reply or not reply.split(b"process_id:", 1)[1].count(b"\r\n"):
                    chunk = sock.recv(65536)
                    if not chunk:
                        return False
                    reply += chunk
        except OSError:
            return False
        return int(reply.split(b"process_id:", 1)[1].split(b"\r\n", 1)[0]) == pid

    def __enter__(self) -> RedisServer:
        try:
            return self.start()
        except BaseException:
            self.close()
            raise

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
