"""The processes of `prefixserve bench routing`: a redis-server, N `prefixserve serve` replicas with
vLLM KV events on, and per policy a fresh vllm-router in front of them (the flags of compose's router
entrypoint), plus the small HTTP helpers the benchmark uses to drive and read them."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get(url: str, timeout: float = 5.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def post(url: str, body: dict[str, Any] | None = None, timeout: float = 600.0) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def wait_ready(url: str, proc: subprocess.Popen[bytes], what: str, timeout: float = 900.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except (OSError, urllib.error.HTTPError):
            pass
        if proc.poll() is not None:
            raise SystemExit(f"{what} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise SystemExit(f"{what} never became ready")
        time.sleep(0.25)


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    """SIGTERM, then SIGKILL if it has not exited within `timeout` seconds."""
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()


def metric(url: str, name: str) -> float:
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith(name + " ") or line.startswith(name + "{"):   # vllm: series carry labels
                return float(line.rsplit(" ", 1)[1])
    return 0.0


# -- the processes ------------------------------------------------------------------------------
class Deployment:
    """redis-server, N `prefixserve serve` replicas (KV events on) and, per policy, a vllm-router."""

    def __init__(self, args: argparse.Namespace, workdir: Path) -> None:
        self.args, self.workdir = args, workdir
        self.procs: list[subprocess.Popen[bytes]] = []
        self.redis_port = free_port()
        self.replicas: list[dict[str, Any]] = [
            {"port": free_port(), "events": free_port(), "replay": free_port()} for _ in range(args.replicas)]
        self.router: subprocess.Popen[bytes] | None = None
        self.router_url = ""

    def _spawn(self, cmd: list[str], log: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(self.workdir / log, "wb") as out:      # the child keeps its own copy of the descriptor
            proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, stderr=subprocess.STDOUT,
                                    stdout=out)
        self.procs.append(proc)
        return proc

    def start(self) -> None:
        redis = shutil.which("redis-server")
        if redis is None:
            raise SystemExit("redis-server not found on PATH (the registered-prefix policy syncs through Redis)")
        self._spawn([redis, "--port", str(self.redis_port), "--bind", "127.0.0.1", "--save", "",
                     "--appendonly", "no", "--dir", str(self.workdir)], "redis.log")
        a = self.args
        for i, r in enumerate(self.replicas):
            events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                 "endpoint": f"tcp://*:{r['events']}", "replay_endpoint": f"tcp://*:{r['replay']}"})
            cmd = [sys.executable, "-m", "service", "serve", "--host", "127.0.0.1", "--port", str(r["port"]),
                   "--block-size", "16", "--num-kv-blocks", str(a.num_kv_blocks), "--max-num-seqs", "32",
                   "--max-model-len", "2048", "--redis-url", f"redis://127.0.0.1:{self.redis_port}/0",
                   "--served-model-name", "prefixserve", "--kv-events-config", events]
            if a.model:
                cmd += ["--model", a.model]
            if a.threads > 0:
                cmd += ["--torch-threads", str(a.threads)]
            r["url"] = f"http://127.0.0.1:{r['port']}"
            r["proc"] = self._spawn(cmd, f"replica{i}.log")
        for i, r in enumerate(self.replicas):
            wait_ready(f"{r['url']}/health", r["proc"], f"replica {i}")
            post(f"{r['url']}/v1/completions", {"prompt": "warm up", "max_tokens": 2})   # first pass: slow

    def start_router(self, policy: str) -> None:
        port = free_port()
        urls = [r["url"] for r in self.replicas]
        cmd = [str(Path(sys.executable).parent / "vllm-router"), "--host", "127.0.0.1", "--port", str(port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               "--policy", "round_robin" if policy == "registered" else policy, "--worker-urls", *urls,
               "--worker-startup-check-interval", "2", "--health-check-interval-secs", "5"]
        if policy == "kv_aware":
            for r in self.replicas:
                cmd += ["--kv-event-source", f"{r['url']}=tcp://127.0.0.1:{r['events']}",
                        "--kv-event-replay-source", f"{r['url']}=tcp://127.0.0.1:{r['replay']}"]
            cmd += ["--kv-event-model", "prefixserve", "--kv-event-block-size", "16"]
        self.router = self._spawn(cmd, f"router-{policy}.log")
        self.router_url = f"http://127.0.0.1:{port}"
        wait_ready(f"{self.router_url}/readiness", self.router, "vllm-router", timeout=120)

    def stop_router(self) -> None:
        if self.router is not None:
            self.router.terminate()
            self.router.wait(30)
            self.procs.remove(self.router)
            self.router = None

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
