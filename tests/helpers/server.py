"""The one test harness for a real prefixserve server on a free loopback port, two ways to run it:

- ServerThread: the app in this process, on its own uvloop thread (tests may read the engine's state
  through `state`, or run a coroutine on the server's loop with `call`);
- ServerProcess: `python -m service serve` as a child process (for replicas, restarts, SIGTERM).

Both expose `url`, `health()`, `wait_ready()`, `metric(name)` and `stop()`; tests talk to either over
TCP like any client would.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import uvloop
from aiohttp import web

from service.app import create_app, make_runner
from service.config import ServiceConfig
from service.state import STATE, ServiceState
from tests.helpers.redis_server import free_port

ROOT = Path(__file__).resolve().parents[2]


def http(method: str, url: str, body: Any = None, timeout: float = 60.0,
         headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """One JSON request; (status, parsed body or text). Never raises for an HTTP error status."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method,
                                 headers={"Content-Type": "application/json", **(headers or {})})
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


def status_of(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def tiny_config(model_dir: Any, **overrides: Any) -> ServiceConfig:
    """The tiny-checkpoint server the service tests share: 256-token context, 512 KV blocks of 16."""
    base: dict[str, Any] = dict(model=str(model_dir), max_model_len=256, num_kv_blocks=512, max_num_seqs=64,
                                keepalive_interval=5.0, shutdown_timeout=5.0)
    return ServiceConfig.from_flat(**{**base, **overrides})


def fresh_system_prompt(words: int = 8) -> str:
    """A system prompt no other test sent, so nothing of it is cached yet, its first block included: the random tag
    leads (the chat template's 7 tokens, then the tag's characters). After "Policy " (the tiny checkpoint's 384-token
    vocabulary), only the tag's first 2-3 characters fell in block 0: one earlier prompt in 256 shared that block."""
    return f"{uuid.uuid4().hex} policy: " + " ".join(f"rule{i} applies" for i in range(words))


class _Server:
    port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def health(self) -> int:
        try:
            return status_of(f"{self.url}/health")
        except OSError:
            return 0

    def _alive(self) -> str | None:
        """None while the server can still become ready, else why it cannot."""
        return None

    def wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while self.health() != 200:
            problem = self._alive()
            assert problem is None, problem
            assert time.monotonic() < deadline, "server never became ready"
            time.sleep(0.05)

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=10) as resp:
            for line in resp.read().decode().splitlines():
                if line.startswith(name + " ") or line.startswith(name + "{"):
                    return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)


class ServerThread(_Server):
    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.loop = uvloop.new_event_loop()
        self.app: web.Application = create_app(config)
        self.runner = make_runner(self.app)
        self.port = 0
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)

    @property
    def state(self) -> ServiceState:
        return self.app[STATE]

    def _alive(self) -> str | None:
        return self.state.load_error

    def start(self, wait_ready: bool = True, timeout: float = 120.0) -> ServerThread:
        self._thread.start()
        self.call(self._start())
        if wait_ready:
            self.wait_ready(timeout)
        return self

    async def _start(self) -> None:
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.port = self.runner.addresses[0][1]

    def call(self, coro: Any, timeout: float = 60.0) -> Any:
        """Runs a coroutine on the server's loop (e.g. to read engine state) and returns its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.call(self.runner.cleanup(), timeout=120.0)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        self.loop.close()


class ServerProcess(_Server):
    def __init__(self, args: list[str], env: dict[str, str] | None = None, port: int | None = None) -> None:
        self.port = port if port is not None else free_port()
        self.args = ["--host", "127.0.0.1", "--port", str(self.port), *args]
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="prefixserve-", suffix=".log", delete=False)

    def start(self, wait_ready: bool = True, timeout: float = 120.0) -> ServerProcess:
        self.proc = subprocess.Popen([sys.executable, "-m", "service", "serve", *self.args], env=self.env,
                                     stdout=self._log, stderr=subprocess.STDOUT, cwd=str(ROOT))
        if wait_ready:
            self.wait_ready(timeout)
        return self

    def _alive(self) -> str | None:
        if self.proc is None or self.proc.poll() is not None:
            return f"server exited:\n{self.log()}"
        return None

    def log(self, tail: int | None = 4000) -> str:
        """The server's output so far: its last `tail` characters, or all of it with None."""
        text = Path(self._log.name).read_text(errors="replace")
        return text if tail is None else text[-tail:]

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
