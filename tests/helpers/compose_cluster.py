"""compose.yaml run on loopback: its engine command as replica processes, its router service (the
entrypoint and the real vllm-router) in front of them, a real redis-server behind them.

Only what a container would have differently is changed: each replica's host/port (ServerProcess adds
them), the model (a tiny checkpoint instead of the /models mount), its ZMQ ports (all replicas share
one host here) and the router's names for the replicas (`ReplicaPorts.env`).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from tests.helpers.redis_server import RedisServer
from tests.helpers.router_process import ReplicaPorts, RouterProcess
from tests.helpers.server import ROOT, ServerProcess

_VAR = re.compile(r"\$\$|\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


def compose() -> dict[str, Any]:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """Compose's variable substitution: $$, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error}."""
    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name, op, arg = m.group(1), m.group(2), m.group(3)
        value = env.get(name)
        if op in (":-", ":?") and not value:
            value = None
        if value is None:
            if op in (":?", "?"):
                raise ValueError(f"{name}: {arg}")
            return arg if op in (":-", "-") else ""
        return value
    return _VAR.sub(sub, value)


def engine_args(model: Path, ports: ReplicaPorts, i: int, env: Mapping[str, str]) -> list[str]:
    """The engine service's command for replica i, without the program name and --host/--port."""
    cmd = [interpolate(a, env) for a in compose()["services"]["engine"]["command"]]
    assert cmd[:2] == ["prefixserve", "serve"]
    out: list[str] = []
    args = iter(cmd[2:])
    for a in args:
        if a in ("--host", "--port"):
            next(args)
        elif a == "--kv-events-config":
            next(args)
            out += [a, ports.kv_config(i)]
        else:
            out.append(str(model) if a == "/models" else a)
    return out


def router_env(ports: ReplicaPorts, env: Mapping[str, str]) -> dict[str, str]:
    service = compose()["services"]["router"]
    assert service["command"] == ["router-entrypoint"]
    return {**{k: interpolate(str(v), env) for k, v in service["environment"].items()}, **ports.env()}


class Cluster:
    """N replicas from the compose engine command on one real Redis; routers started on demand."""

    def __init__(self, model: Path, n: int = 3, env: Mapping[str, str] | None = None,
                 sizing: tuple[str, ...] = ("--num-kv-blocks", "256", "--max-model-len", "512")) -> None:
        self.env = dict(env or {})
        self.ports = ReplicaPorts(n)
        self.redis = RedisServer()
        self.replicas = [ServerProcess([*engine_args(model, self.ports, i, self.env), *sizing], port=self.ports.port(i),
                                       env={"PREFIXSERVE_REDIS_URL": self.redis.url}) for i in range(1, n + 1)]

    def start(self) -> Cluster:
        """Starts everything, or stops what it started and re-raises."""
        try:
            self.redis.start()
            for r in self.replicas:
                r.start(wait_ready=False)
            for r in self.replicas:
                r.wait_ready(300.0)        # three replicas loading at once on a busy 2-core CI machine
        except BaseException:
            self.stop()
            raise
        return self

    def router(self, policy: str | None = None, extra_args: list[str] | None = None) -> RouterProcess:
        env = {**self.env, **({"ROUTER_POLICY": policy} if policy else {})}
        return RouterProcess(router_env(self.ports, env), extra_args).start()

    def stop(self) -> None:
        for r in self.replicas:
            r.stop()
        self.redis.close()
