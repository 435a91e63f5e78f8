"""A real prefixserve server on a free loopback port, run on its own uvloop thread.

Tests (sync or async, any event loop) talk to it over TCP like any client would.
"""
from __future__ import annotations

import asyncio
import threading
import time
import urllib.error
import urllib.request
from typing import Any

import uvloop
from aiohttp import web

from service.app import create_app, make_runner
from service.config import ServiceConfig
from service.state import STATE, ServiceState


class ServerThread:
    def __init__(self, config: ServiceConfig) -> None:
        self.config = config
        self.loop = uvloop.new_event_loop()
        self.app: web.Application = create_app(config)
        self.runner = make_runner(self.app)
        self.port = 0
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-server", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def state(self) -> ServiceState:
        return self.app[STATE]

    def start(self, wait_ready: bool = True, timeout: float = 120.0) -> ServerThread:
        self._thread.start()
        self.call(self._start())
        if wait_ready:
            deadline = time.monotonic() + timeout
            while _status(f"{self.url}/health") != 200:
                assert self.state.load_error is None, self.state.load_error
                assert time.monotonic() < deadline, "server never became ready"
                time.sleep(0.05)
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


def tiny_config(model_dir: Any, **overrides: Any) -> ServiceConfig:
    base: dict[str, Any] = dict(model=str(model_dir), max_model_len=256, num_kv_blocks=512, max_num_seqs=64,
                                keepalive_interval=5.0, shutdown_timeout=5.0)
    return ServiceConfig.from_flat(**{**base, **overrides})


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code
