"""compose.yaml: its structure, and its router and engine commands run for real on loopback: the real
vllm-router (through the router image's entrypoint) in front of three engine processes and a redis-server."""
from __future__ import annotations

import re
from importlib import metadata
from pathlib import Path
from urllib.parse import urlsplit

import redis as redis_py

from cli import parser
from engine.kv.events import KVEventsConfig
from service import flags
from service.config import ServiceConfig
from service.middleware.cross_site import Hosts, host_name
from tests.helpers.compose_cluster import Cluster, compose, engine_args, interpolate
from tests.helpers.router_process import ENTRYPOINT, ReplicaPorts, ephemeral_low
from tests.helpers.server import ROOT, http


def test_compose_structure() -> None:
    c = compose()
    router, engine, redis = (c["services"][s] for s in ("router", "engine", "redis"))
    assert "--appendonly" in redis["command"] and redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    assert any(v.startswith("redis-data:") for v in redis["volumes"]) and "redis-data" in c["volumes"]
    assert "redis-cli" in redis["healthcheck"]["test"]
    # one published port, the router's
    assert router["ports"] == ["8000:8000"]
    assert [name for name, s in c["services"].items() if "ports" in s] == ["router"]
    # the router: the upstream package, pinned, from Dockerfile.router; its entrypoint is ours
    version = router["build"]["args"]["VLLM_ROUTER_VERSION"]
    assert router["build"]["dockerfile"] == "Dockerfile.router" and version == metadata.version("vllm-router")
    dockerfile = (ROOT / "Dockerfile.router").read_text()
    assert f"ARG VLLM_ROUTER_VERSION={version}" in dockerfile
    assert 'pip install "vllm-router==${VLLM_ROUTER_VERSION}"' in dockerfile
    assert "COPY deploy/router-entrypoint.sh /usr/local/bin/router-entrypoint" in dockerfile
    assert router["command"] == ["router-entrypoint"] and ENTRYPOINT.stat().st_mode & 0o111
    assert router["depends_on"]["engine"]["condition"] == "service_healthy"
    assert "/readiness" in " ".join(router["healthcheck"]["test"])
    env = router["environment"]
    assert interpolate(env["ROUTER_POLICY"], {}) == "cache_aware"
    assert interpolate(env["ROUTER_POLICY"], {"ROUTER_POLICY": "kv_aware"}) == "kv_aware"
    # one variable scales both sides: the replicas and the router's list of them
    assert env["ENGINE_REPLICAS"] == engine["deploy"]["replicas"] == "${ENGINE_REPLICAS:-3}"
    assert interpolate(env["ENGINE_URL"], {}) % 2 == "http://prefixserve-engine-2:8000"
    # the engines: no host port, Redis, health on /health, vLLM-format KV events where the router looks
    assert engine["build"]["context"] == "."
    assert engine["depends_on"]["redis"]["condition"] == "service_healthy"
    assert engine["environment"]["PREFIXSERVE_REDIS_URL"].startswith("redis://redis:")
    assert any(v.endswith(":/models:ro") for v in engine["volumes"])
    assert "/health" in " ".join(engine["healthcheck"]["test"])
    assert (ROOT / "Dockerfile").exists()
    cmd = [interpolate(a, {}) for a in engine["command"]]
    assert cmd[:2] == ["prefixserve", "serve"]
    args = parser().parse_args(cmd[1:])                 # every flag is a real CLI flag
    events = KVEventsConfig.from_json(args.kv_events_config)
    assert events.enabled and events.endpoint == "tcp://*:5557" and events.replay_endpoint == "tcp://*:5558"
    assert env["ENGINE_KV_EVENTS"].endswith(":5557") and env["ENGINE_KV_REPLAY"].endswith(":5558")
    assert args.served_model_name == interpolate(env["MODEL_NAME"], {}) == "prefixserve"
    assert str(args.block_size) == interpolate(env["BLOCK_SIZE"], {}) == "16"
    # the replicas answer to the names the router calls them by (a Host they do not know gets 421)
    hosts = Hosts(ServiceConfig(**flags.values(args, ServiceConfig)))
    for i in (1, 3, 12):
        assert hosts.allowed(host_name(urlsplit(interpolate(env["ENGINE_URL"], {}) % i).netloc))
    assert not hosts.allowed(host_name("prefixserve-engine-1.evil.net")) and not hosts.allowed("evil.net")


def test_interpolate_is_composes() -> None:
    assert interpolate("${A:-x} ${A-y} ${B} $${A}", {"A": ""}) == "x   ${A}"
    assert interpolate("${A:?set A}", {"A": "1"}) == "1"
    try:
        interpolate("${MODEL_DIR:?set MODEL_DIR}", {})
        raise AssertionError("must refuse")
    except ValueError as exc:
        assert "set MODEL_DIR" in str(exc)


def test_engine_args_are_the_compose_command(tiny_llama_dir: Path) -> None:
    ports = ReplicaPorts(2)
    args = engine_args(tiny_llama_dir, ports, 2, {})
    assert "--host" not in args and "--port" not in args and str(tiny_llama_dir) in args
    assert KVEventsConfig.from_json(args[args.index("--kv-events-config") + 1]).endpoint == \
        f"tcp://127.0.0.1:{ports.events * 10 + 2}"


def test_replica_ports_stay_below_the_ephemeral_range() -> None:
    """The replicas' ports are chosen free, then bound seconds later by servers still loading: inside the kernel's
    ephemeral range, a replica's own outgoing connection could take one first (a CI run failed so)."""
    low = ephemeral_low()
    for _ in range(20):
        ports = ReplicaPorts(3)
        chosen = [base * 10 + i for base in (ports.http, ports.events, ports.replay) for i in (1, 2, 3)]
        assert len(set(chosen)) == 9 and all(10000 < p < low for p in chosen)


def test_compose_commands_run(tiny_llama_dir: Path) -> None:
    cluster = Cluster(tiny_llama_dir, n=3).start()
    try:
        with cluster.router() as router:                  # compose's default policy
            assert "policy: CacheAware" in router.log()
            status, workers = http("GET", f"{router.url}/workers")
            assert status == 200 and sorted(w["url"] for w in workers["workers"]) == \
                sorted(r.url for r in cluster.replicas) and all(w["is_healthy"] for w in workers["workers"])
            status, out = http("POST", f"{router.url}/v1/completions",
                               {"model": "prefixserve", "prompt": "hello", "max_tokens": 2})
            assert status == 200 and out["model"] == "prefixserve", out
            status, rec = http("POST", f"{router.url}/v1/prefixes", {"name": "compose", "prompt": "hello " * 40})
            assert status == 201, rec
            client = redis_py.Redis.from_url(cluster.redis.url)
            assert any(b"compose" in k for k in client.keys("*"))      # the record went to this Redis
            client.close()
        with cluster.router("kv_aware") as router:          # each replica's ZMQ stream is attached
            log = router.log()
            assert "policy: KvAware" in log and len(re.findall(r"spawned subscriber rank0", log)) == 3
            assert http("POST", f"{router.url}/v1/completions", {"prompt": "hi", "max_tokens": 1})[0] == 200
    finally:
        cluster.stop()
