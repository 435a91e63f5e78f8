"""Every kind of bad input gets its 4xx in the OpenAI error shape, and the server keeps serving."""
from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import requests

from tests.helpers.server import ServerThread, tiny_config

MSG = [{"role": "user", "content": "hi"}]
CASES = [
    # (path, raw body or json, status, param)
    ("/v1/completions", b"{not json", 400, None),
    ("/v1/completions", b"\xff\xfe", 400, None),
    ("/v1/completions", [1, 2], 400, None),
    ("/v1/completions", {}, 400, "prompt"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": []}, 400, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], []]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [True]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [10**9]}, 400, "prompt"),
    ("/v1/completions", {"prompt": [-1]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2.5}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": 10**12}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "temperature": True}, 400, "temperature"),
    ("/v1/completions", {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_p": 1.5}, 400, "top_p"),
    ("/v1/completions", {"prompt": "hi", "top_k": -2}, 400, "top_k"),
    ("/v1/completions", {"prompt": "hi", "n": 0}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "n": 100000}, 400, "n"),
    ("/v1/completions", {"prompt": ["a"] * 100, "n": 2}, 400, "n"),
    ("/v1/completions", {"prompt": "hi", "stop": 3}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "stop": [""]}, 400, "stop"),
    ("/v1/completions", {"prompt": "hi", "seed": "x"}, 400, "seed"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    ("/v1/completions", {"prompt": "hi", "stream_options": []}, 400, "stream_options"),
    ("/v1/completions", {"prompt": "hi", "ignore_eos": 1}, 400, "ignore_eos"),
    ("/v1/completions", {"prompt": "hi", "user": 5}, 400, "user"),
    ("/v1/completions", {"prompt": "hi " * 400}, 400, "prompt"),            # beyond max_model_len
    ("/v1/completions", {"prompt": "hi", "model": "gpt-4"}, 404, "model"),
    ("/v1/completions", {"prompt": "hi", "model": 3}, 400, "model"),
    ("/v1/completions", {"prompt": "hi", "prefix": "nope"}, 404, "prefix"),
    ("/v1/chat/completions", {}, 400, "messages"),
    ("/v1/chat/completions", {"messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"messages": ["hi"]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": MSG, "max_completion_tokens": -3}, 400, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 5000}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": MSG, "model": "nope"}, 404, "model"),
]


@pytest.mark.parametrize("path,body,status,param", CASES, ids=[f"{i}-{c[0].split('/')[-1]}-{c[3]}" for i, c in
                                                              enumerate(CASES)])
def test_bad_input(server: ServerThread, path: str, body, status: int, param: str | None) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    resp = requests.post(server.url + path, data=data, headers={"Content-Type": "application/json"}, timeout=30)
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    if status == 404:
        assert err["code"] in ("model_not_found", "prefix_not_found")
    else:
        assert err["type"] == "invalid_request_error"


def test_unknown_route_and_method(server: ServerThread) -> None:
    r = requests.get(f"{server.url}/v1/nothing", timeout=10)
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = requests.get(f"{server.url}/v1/completions", timeout=10)
    assert r.status_code == 405 and "POST" in r.headers["Allow"] and "error" in r.json()
    r = requests.get(f"{server.url}/v1/ws", timeout=10)   # not an upgrade
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


def test_still_serving_after_bad_input(server: ServerThread, model_name: str) -> None:
    for path, body, _, _ in CASES[:5]:
        requests.post(server.url + path, data=body if isinstance(body, bytes) else json.dumps(body), timeout=30)
    r = requests.post(f"{server.url}/v1/completions", json={"model": model_name, "prompt": "hi", "max_tokens": 3},
                      timeout=30)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] >= 1


def test_load_failure_is_503(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')   # a checkpoint we cannot load
    srv = ServerThread(tiny_config(tmp_path)).start(wait_ready=False)
    try:
        for _ in range(200):
            if srv.state.load_error is not None:
                break
            threading.Event().wait(0.05)
        assert requests.get(f"{srv.url}/health", timeout=10).json() == {"status": "failed"}
        r = requests.post(f"{srv.url}/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "load_failed"
    finally:
        srv.stop()


def test_health_503_while_warming(tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import service.app as app_module
    release = threading.Event()
    real = app_module._build_engine

    def slow(config):  # type: ignore[no-untyped-def]
        release.wait(30)
        return real(config)

    monkeypatch.setattr(app_module, "_build_engine", slow)
    srv = ServerThread(tiny_config(tiny_llama_dir)).start(wait_ready=False)
    try:
        r = requests.get(f"{srv.url}/health", timeout=10)
        assert r.status_code == 503 and r.json() == {"status": "warming"}
        r = requests.post(f"{srv.url}/v1/completions", json={"prompt": "hi"}, timeout=10)
        assert r.status_code == 503 and r.json()["error"]["code"] == "warming" and r.headers["Retry-After"]
        release.set()
        for _ in range(400):
            if requests.get(f"{srv.url}/health", timeout=10).status_code == 200:
                break
            threading.Event().wait(0.05)
        assert requests.get(f"{srv.url}/health", timeout=10).json()["status"] == "ok"
    finally:
        release.set()
        srv.stop()


def test_engine_errors_map_to_statuses() -> None:
    from engine.errors import EngineDead, EngineError, InvalidRequest, PinCapExceeded, QueueFull
    from service.errors import to_api_error
    got = {type(e).__name__: (to_api_error(e).status, to_api_error(e).param, to_api_error(e).headers) for e in
           [InvalidRequest("bad", param="top_p"), QueueFull("full"), PinCapExceeded("cap"), EngineDead("dead"),
            EngineError("boom")]}
    assert got == {"InvalidRequest": (400, "top_p", {}), "QueueFull": (429, None, {"Retry-After": "1"}),
                   "PinCapExceeded": (507, None, {}), "EngineDead": (503, None, {}), "EngineError": (500, None, {})}
