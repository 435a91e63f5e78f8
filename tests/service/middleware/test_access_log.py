"""Access log and request ids, read from a real `prefixserve serve` process's output: one JSON line per
request (`--log-format json`) with the id the response echoed, the route template, status, duration
and the generation's tokens; a WebSocket's line sums its generations; the level filters them."""
from __future__ import annotations

import asyncio
import json
import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import requests

from service.logs import JsonFormatter
from service.middleware.access_log import MAX_ID_LEN, request_id
from tests.helpers.server import ServerProcess

ARGS = ["--max-model-len", "256", "--num-kv-blocks", "256", "--shutdown-timeout", "5"]


@pytest.fixture(scope="module")
def json_server(tiny_llama_dir: Path) -> Iterator[ServerProcess]:
    with ServerProcess(["--model", str(tiny_llama_dir), *ARGS, "--log-format", "json"]) as srv:
        srv.start()
        yield srv


def access_lines(text: str) -> dict[str, dict[str, Any]]:
    """request_id -> its access line, from JSON log output (every record must be one JSON object)."""
    out = {}
    for line in text.splitlines():
        if not line.startswith("{"):
            assert not re.match(r"\d{4}-\d\d-\d\d .* (DEBUG|INFO|WARNING|ERROR) ", line), line
            continue
        rec = json.loads(line)
        assert {"time", "level", "logger", "message"} <= set(rec)
        if rec["logger"] == "service.access":
            assert rec["request_id"] not in out, "one line per request"
            out[rec["request_id"]] = rec
    return out


def complete(url: str, rid: str | None, **body: Any) -> requests.Response:
    headers = {"X-Request-Id": rid} if rid is not None else {}
    resp = requests.post(f"{url}/v1/completions", headers=headers, timeout=60,
                         json={"prompt": "hello there", "max_tokens": 4, "ignore_eos": True, **body})
    assert resp.status_code == 200, resp.text
    return resp


async def _ws(url: str, rid: str) -> tuple[str, list[dict[str, Any]]]:
    async with aiohttp.ClientSession() as s, s.ws_connect(f"{url}/v1/ws", headers={"X-Request-Id": rid}) as ws:
        echoed = ws._response.headers["X-Request-Id"]
        usages = []
        for gid, n in ((1, 3), (2, 5)):
            await ws.send_json({"type": "generate", "id": gid, "prompt": "hi", "max_tokens": n, "ignore_eos": True})
            while (msg := await ws.receive_json())["type"] != "done":
                pass
            usages.append(msg["usage"])
        return echoed, usages


def test_request_ids_and_json_access_lines(json_server: ServerProcess) -> None:
    url = json_server.url
    plain = complete(url, "client-id-1")
    assert plain.headers["X-Request-Id"] == "client-id-1"
    dirty = complete(url, "bad id <x>\"'/é")
    assert dirty.headers["X-Request-Id"] == "badidx"
    long = complete(url, "a" * 300)
    assert long.headers["X-Request-Id"] == "a" * MAX_ID_LEN
    fresh = complete(url, None)
    assert re.fullmatch(r"[0-9a-f]{32}", fresh.headers["X-Request-Id"])
    with requests.post(f"{url}/v1/completions", headers={"X-Request-Id": "sse-1"}, stream=True, timeout=60,
                       json={"prompt": "hi", "max_tokens": 6, "ignore_eos": True, "stream": True,
                             "stream_options": {"include_usage": True}}) as sse:
        assert sse.headers["X-Request-Id"] == "sse-1"        # on a stream, sent before the first event
        events = [e for e in sse.iter_lines() if e.startswith(b"data: {")]
    sse_usage = json.loads(events[-1][6:])["usage"]
    with requests.post(f"{url}/v1/completions", headers={"X-Request-Id": "cut-1"}, stream=True, timeout=60,
                       json={"prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True}) as cut:
        next(cut.iter_lines())                               # one event, then the client goes away
    missing = requests.get(f"{url}/nope/deeper", headers={"X-Request-Id": "nf-1"}, timeout=10)
    assert missing.status_code == 404 and missing.headers["X-Request-Id"] == "nf-1"
    bad = requests.post(f"{url}/v1/completions", data=b"{", headers={"X-Request-Id": "bad-1",
                                                                      "Content-Type": "application/json"}, timeout=10)
    assert bad.status_code == 400 and bad.headers["X-Request-Id"] == "bad-1"
    ws_id, ws_usages = asyncio.run(_ws(url, "ws-1"))
    assert ws_id == "ws-1"

    json_server.stop()          # lines of streams and sockets are written when they end
    lines = access_lines(json_server.log(tail=None))
    for resp in (plain, dirty, long, fresh):
        rec = lines[resp.headers["X-Request-Id"]]
        usage = resp.json()["usage"]
        assert (rec["method"], rec["route"], rec["path"], rec["status"]) == ("POST", "/v1/completions",
                                                                              "/v1/completions", 200)
        assert rec["remote"] == "127.0.0.1" and rec["duration_ms"] > 0
        assert (rec["prompt_tokens"], rec["completion_tokens"], rec["cached_tokens"]) == (
            usage["prompt_tokens"], usage["completion_tokens"], usage["prompt_tokens_details"]["cached_tokens"])
    rec = lines["sse-1"]
    assert rec["status"] == 200 and rec["completion_tokens"] == sse_usage["completion_tokens"] == 6
    assert rec["prompt_tokens"] == sse_usage["prompt_tokens"]
    rec = lines["cut-1"]
    assert rec["route"] == "/v1/completions" and 1 <= rec["completion_tokens"] < 200
    rec = lines["nf-1"]
    assert (rec["route"], rec["path"], rec["status"]) == ("unmatched", "/nope/deeper", 404)
    assert "prompt_tokens" not in rec
    assert lines["bad-1"]["status"] == 400
    rec = lines["ws-1"]
    assert (rec["method"], rec["route"], rec["status"]) == ("GET", "/v1/ws", 101)
    assert rec["completion_tokens"] == sum(u["completion_tokens"] for u in ws_usages) == 8
    assert rec["prompt_tokens"] == sum(u["prompt_tokens"] for u in ws_usages)


def test_log_level_and_text_format(capsys: pytest.CaptureFixture[str]) -> None:
    """`configure` as `serve` calls it (the flags themselves are generated: tests/test_cli.py)."""
    from service.logs import configure
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    try:
        configure("text", "warning")
        logging.getLogger("service.access").info("request_id=quiet-1 status=200")
        logging.getLogger("service").warning("loud-1")
        configure("text", "debug")
        logging.getLogger("service.access").info("request_id=shown-1 status=200")
        err = capsys.readouterr().err
    finally:
        root.handlers[:] = handlers
        root.setLevel(level)
    assert "quiet-1" not in err
    assert re.search(r"^\d{4}-\d\d-\d\d [\d:,]+ WARNING service: loud-1$", err, re.M), err
    assert re.search(r"^\S+ \S+ INFO service.access: request_id=shown-1 status=200$", err, re.M), err


def test_text_line_escapes_what_a_client_controls(caplog: pytest.LogCaptureFixture) -> None:
    """A path is the only free text in a line: quoted and escaped, it cannot forge another line."""
    from service.middleware import access_log
    line = access_log._text({"request_id": "r-1", "path": '/v1/x"\nINFO forged=1', "status": 404})
    assert "\n" not in line and line == 'request_id=r-1 path="/v1/x\\"\\nINFO forged=1" status=404'
    assert request_id("  ") != request_id("  ") and len(request_id(None)) == 32
    record = logging.LogRecord("service.access", logging.INFO, __file__, 1, "m", None, None)
    record.fields = {"request_id": "r-2", "status": 200}
    out = json.loads(JsonFormatter().format(record))
    assert (out["request_id"], out["status"], out["level"], out["message"]) == ("r-2", 200, "INFO", "m")
