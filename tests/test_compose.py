"""compose.yaml: its structure, and its engine command line run for real against a local redis-server."""
from __future__ import annotations

from pathlib import Path

import yaml

from service.cli import parser
from tests.helpers.redis_server import RedisServer
from tests.helpers.server import ROOT, ServerProcess, http


def compose() -> dict:
    return yaml.safe_load((ROOT / "compose.yaml").read_text())


def test_compose_structure() -> None:
    c = compose()
    redis, engine = c["services"]["redis"], c["services"]["engine"]
    assert "--appendonly" in redis["command"] and redis["command"][redis["command"].index("--appendonly") + 1] == "yes"
    assert any(v.startswith("redis-data:") for v in redis["volumes"]) and "redis-data" in c["volumes"]
    assert "redis-cli" in redis["healthcheck"]["test"]
    assert engine["build"]["context"] == "."
    assert engine["depends_on"]["redis"]["condition"] == "service_healthy"
    assert engine["environment"]["PREFIXSERVE_REDIS_URL"].startswith("redis://redis:")
    assert any(v.endswith(":/models:ro") for v in engine["volumes"])
    assert "/health" in " ".join(engine["healthcheck"]["test"])
    assert "replicas" in engine["deploy"]
    assert (ROOT / "Dockerfile").exists()
    cmd = engine["command"]
    assert cmd[:2] == ["prefixserve", "serve"]
    parser().parse_args(cmd[1:])                         # every flag is a real CLI flag


def test_compose_engine_command_runs(tiny_llama_dir: Path) -> None:
    cmd = compose()["services"]["engine"]["command"][2:]
    args = []
    skip = False
    for a in cmd:                          # host and port are the test's; the model is mounted here
        if skip:
            skip = False
            continue
        if a in ("--host", "--port"):
            skip = True
            continue
        args.append(str(tiny_llama_dir) if a == "/models" else a)
    with RedisServer() as redis:
        srv = ServerProcess(args, env={"PREFIXSERVE_REDIS_URL": redis.url}).start()
        try:
            status, rec = http("POST", f"{srv.url}/v1/prefixes", {"name": "compose", "prompt": "hello " * 40})
            assert status == 201, rec
            assert redis.url                                       # the record went to this Redis:
            import redis as redis_py
            client = redis_py.Redis.from_url(redis.url)
            assert any(b"compose" in k for k in client.keys("*"))
            client.close()
        finally:
            srv.stop()
