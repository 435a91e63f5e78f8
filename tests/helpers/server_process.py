"""`prefixserve serve` as a real child process on a free loopback port (for replicas and restarts)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from tests.helpers.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]


def http(method: str, url: str, body: Any = None, timeout: float = 60.0) -> tuple[int, Any]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            raw = resp.read()
            status = resp.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


class ServerProcess:
    def __init__(self, args: list[str], env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.args = ["--host", "127.0.0.1", "--port", str(self.port), *args]
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="prefixserve-", suffix=".log", delete=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, wait_ready: bool = True, timeout: float = 120.0) -> ServerProcess:
        self.proc = subprocess.Popen([sys.executable, "-m", "service", "serve", *self.args], env=self.env,
                                     stdout=self._log, stderr=subprocess.STDOUT, cwd=str(ROOT))
        if wait_ready:
            self.wait_ready(timeout)
        return self

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self.health() != 200:
            assert self.proc is not None and self.proc.poll() is None, f"server exited:\n{self.log()}"
            assert time.monotonic() < deadline, f"server never became ready:\n{self.log()}"
            time.sleep(0.1)

    def health(self) -> int:
        try:
            return http("GET", f"{self.url}/health", timeout=2)[0]
        except OSError:
            return 0

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(name + " ") or line.startswith(name + "{"):
                    return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def log(self) -> str:
        return Path(self._log.name).read_text(errors="replace")[-4000:]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
