"""compose.yaml's router for real on loopback: deploy/router-entrypoint.sh execs the real vllm-router.

The entrypoint names replica i by printf formats of i (`http://prefixserve-engine-%s:8000` in compose);
here the replicas listen on consecutive loopback ports `<base>1 .. <base>N`, so the format
`http://127.0.0.1:<base>%s` names them. `ReplicaPorts` finds such bases free for HTTP, ZMQ events and
ZMQ replay.
"""
from __future__ import annotations

import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from tests.helpers.redis_server import free_port
from tests.helpers.server import ROOT

ENTRYPOINT = ROOT / "deploy" / "router-entrypoint.sh"


def _free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (outgoing connections and bind(0) take theirs from it)."""
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


class ReplicaPorts:
    """Three port bases (HTTP, KV events, KV replay), each with <base>1..<base>n free (n <= 9), all below the
    ephemeral range: a port free when chosen there could be taken by any outgoing connection (a replica's own
    Redis client) before its replica binds it (seen: "KV events: cannot open ...: Address already in use")."""

    def __init__(self, n: int) -> None:
        assert 1 <= n <= 9
        bases: list[int] = []
        top = min(6000, ephemeral_low() // 10)            # ports 10001 .. below the ephemeral range
        while len(bases) < 3:
            base = random.randrange(1000, top)
            if base not in bases and all(_free(base * 10 + i) for i in range(1, n + 1)):
                bases.append(base)
        self.n = n
        self.http, self.events, self.replay = bases

    def port(self, i: int) -> int:
        return self.http * 10 + i

    def kv_config(self, i: int) -> str:
        """Compose's KV events JSON with replica i's ports, bound on loopback (compose: the container's own
        interfaces)."""
        return ('{"enable_kv_cache_events": true, "publisher": "zmq", '
                f'"endpoint": "tcp://127.0.0.1:{self.events * 10 + i}", '
                f'"replay_endpoint": "tcp://127.0.0.1:{self.replay * 10 + i}"}}')

    def env(self) -> dict[str, str]:
        return {"ENGINE_REPLICAS": str(self.n), "ENGINE_URL": f"http://127.0.0.1:{self.http}%s",
                "ENGINE_KV_EVENTS": f"tcp://127.0.0.1:{self.events}%s",
                "ENGINE_KV_REPLAY": f"tcp://127.0.0.1:{self.replay}%s"}


class RouterProcess:
    def __init__(self, env: dict[str, str], extra_args: list[str] | None = None) -> None:
        self.port = free_port()
        bin_dir = str(Path(sys.executable).parent)              # vllm-router lives next to python
        self.env = {**os.environ, "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}", **env,
                    "ROUTER_HOST": "127.0.0.1", "ROUTER_PORT": str(self.port), "ROUTER_METRICS_PORT": str(free_port())}
        self.args = [str(ENTRYPOINT), *(extra_args or [])]
        self.proc: subprocess.Popen[bytes] | None = None
        self._log = tempfile.NamedTemporaryFile(prefix="vllm-router-", suffix=".log", delete=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 60.0) -> RouterProcess:
        self.proc = subprocess.Popen(self.args, env=self.env, stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while self.status("/readiness") != 200:
            assert self.proc.poll() is None, f"router exited:\n{self.log()}"
            assert time.monotonic() < deadline, f"router never became ready:\n{self.log()}"
            time.sleep(0.1)
        return self

    def status(self, path: str) -> int:
        try:
            with urllib.request.urlopen(self.url + path, timeout=2) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as exc:
            return exc.code
        except OSError:
            return 0

    def log(self) -> str:
        return re.sub(r"\x1b\[[0-9;]*m", "", Path(self._log.name).read_text(errors="replace"))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def __enter__(self) -> RouterProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
