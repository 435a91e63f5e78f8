"""The worker surface a router probes (service/routes/worker_api.py), against the shared live server: the
answers agree with what the generation endpoints and the engine actually do."""
from __future__ import annotations

import json
import time
import urllib.request

import requests

from service.routes import worker_api
from tests.helpers.server import ServerThread

PROMPT = "Routers hash prompts into blocks; this one is long enough to fill a few blocks of sixteen tokens."
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a prime."}]


def post(server: ServerThread, path: str, body: dict | None = None) -> requests.Response:
    return requests.post(f"{server.url}{path}", json=body, timeout=60)


def get(server: ServerThread, path: str) -> requests.Response:
    return requests.get(f"{server.url}{path}", timeout=60)


def test_no_probed_path_is_missing(server: ServerThread) -> None:
    for path in worker_api.GETS:
        r = get(server, path)
        assert r.status_code == 200, (path, r.text)
    assert {"/v1/completions/render", "/v1/chat/completions/render", "/flush_cache"} <= set(worker_api.POSTS)


def test_render_gives_the_tokens_the_completion_runs(server: ServerThread, model_name: str) -> None:
    body = {"model": model_name, "prompt": [PROMPT, "second"], "max_tokens": 1, "return_token_ids": True}
    ran = post(server, "/v1/completions", body).json()["prompt_token_ids"]
    rendered = post(server, "/v1/completions/render", {**body, "stream": True}).json()
    assert [r["token_ids"] for r in rendered] == ran
    assert all(r["model"] == model_name and r["stream"] is True for r in rendered)
    assert rendered[0]["sampling_params"]["max_tokens"] == 1 and rendered[0]["request_id"].startswith("cmpl-")
    assert post(server, "/v1/completions/render", {"prompt": 3}).status_code == 400
    assert post(server, "/v1/completions/render", {"model": "other", "prompt": "x"}).status_code == 404


def test_render_includes_a_named_prefix_like_the_request(server: ServerThread, model_name: str) -> None:
    r = post(server, "/v1/prefixes", {"name": "render-sys", "prompt": PROMPT})
    assert r.status_code in (200, 201), r.text
    body = {"model": model_name, "prompt": "and then", "prefix": "render-sys", "max_tokens": 1,
            "return_token_ids": True}
    ran = post(server, "/v1/completions", body).json()["prompt_token_ids"]
    (rendered,) = post(server, "/v1/completions/render", body).json()
    assert rendered["token_ids"] == ran[0] and len(ran[0]) > r.json()["num_tokens"]
    assert post(server, "/v1/completions/render", {**body, "prefix": "nope"}).status_code == 404
    assert requests.delete(f"{server.url}/v1/prefixes/render-sys", timeout=30).status_code == 200


def test_chat_render_and_tokenize_agree_with_the_chat_endpoint(server: ServerThread, model_name: str) -> None:
    body = {"model": model_name, "messages": MESSAGES, "max_tokens": 1, "return_token_ids": True}
    ran = post(server, "/v1/chat/completions", body).json()["prompt_token_ids"]
    assert post(server, "/v1/chat/completions/render", body).json()["token_ids"] == ran
    tok = post(server, "/tokenize", {"model": model_name, "messages": MESSAGES, "continue_final_message": False}).json()
    assert tok["tokens"] == ran and tok["count"] == len(ran) and tok["max_model_len"] == 256


def test_tokenize_and_detokenize(server: ServerThread, model_name: str) -> None:
    ran = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "return_token_ids": True}).json()
    tok = post(server, "/tokenize", {"model": model_name, "prompt": PROMPT, "return_token_strs": True}).json()
    assert tok["tokens"] == ran["prompt_token_ids"][0] and len(tok["token_strs"]) == tok["count"]
    assert PROMPT in post(server, "/detokenize", {"tokens": tok["tokens"]}).json()["prompt"]
    for bad in ({"prompt": "x", "messages": MESSAGES}, {}, {"prompt": 1}, {"prompt": "x", "add_special_tokens": 1},
                {"messages": MESSAGES, "continue_final_message": True}):
        assert post(server, "/tokenize", bad).status_code == 400, bad
    for bad in ({"tokens": [10**9]}, {"tokens": "x"}, {}):
        assert post(server, "/detokenize", bad).status_code == 400, bad


def test_server_info_and_model_info_describe_this_replica(server: ServerThread, model_name: str) -> None:
    info = get(server, "/get_server_info").json()
    assert info["model_id"] == model_name and info["kv_block_size"] == 16 and info["num_kv_blocks"] == 512
    assert info["max_model_len"] == 256 and info["instance_id"].endswith(f":{server.config.port}")
    assert info["kv_events_config"] is None and "block_size" not in info
    assert get(server, "/kv_event_sources").json() == {}
    model = get(server, "/get_model_info").json()
    assert model["is_generation"] is True and model["model_path"] == info["model_path"]
    assert get(server, "/version").json()["version"]
    assert get(server, "/health_generate").json() == {"status": "ok"}


def test_server_info_and_metrics_name_the_kernels(server: ServerThread) -> None:
    """Which C++ build runs (the one this CPU's flags choose) and what each op runs: the same in
    /get_server_info and in the /metrics info series."""
    from kernels.cpu.library import KernelUnavailable, load
    try:
        variant: str | None = load().variant
    except KernelUnavailable:
        variant = None
    kernels = get(server, "/get_server_info").json()["kernels"]
    assert kernels["cpu_variant"] == variant and kernels["batch_invariant"] is False
    assert kernels["device"] == "cpu" and kernels["cpu_reason"]
    decode = kernels["ops"]["paged decode"]
    assert decode.startswith(f"c++ {variant}") if variant else decode == "torch"
    lines = [line for line in get(server, "/metrics").text.splitlines() if line.startswith("prefixserve_kernels_info{")]
    assert len(lines) == len(kernels["ops"])
    row = next(line for line in lines if 'op="paged decode"' in line)
    assert f'implementation="{decode}"' in row and f'cpu_variant="{variant or "none"}"' in row
    assert 'batch_invariant="false"' in row and row.endswith(" 1.0")


def test_load_counts_requests_in_the_engine(server: ServerThread) -> None:
    assert get(server, "/get_load").json()["load"] == 0
    req = urllib.request.Request(f"{server.url}/v1/completions", method="POST",
                                 headers={"Content-Type": "application/json"},
                                 data=json.dumps({"prompt": "count me", "max_tokens": 200, "ignore_eos": True,
                                                  "stream": True}).encode())
    with urllib.request.urlopen(req, timeout=60) as resp:
        assert resp.readline().startswith(b"data: ")
        busy = get(server, "/get_load").json()
        assert busy["load"] == 1 and busy["num_running_reqs"] == 1 and busy["kv_blocks_used"] >= 1
    deadline = time.monotonic() + 10
    while get(server, "/get_load").json()["load"] != 0:       # the disconnect aborted it
        assert time.monotonic() < deadline
        time.sleep(0.05)


def metric(server: ServerThread, name: str) -> float:
    for line in get(server, "/metrics").text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[1])
    raise KeyError(name)


def test_flush_cache_forgets_cached_blocks(server: ServerThread) -> None:
    assert post(server, "/v1/completions", {"prompt": PROMPT * 2, "max_tokens": 1}).status_code == 200
    assert metric(server, "prefixserve_kv_blocks_cached") > 0
    flushed = post(server, "/flush_cache").json()["flushed_blocks"]
    assert flushed > 0 and metric(server, "prefixserve_kv_blocks_cached") == 0
    assert post(server, "/reset_prefix_cache").json() == {"flushed_blocks": 0}
    again = post(server, "/v1/completions", {"prompt": PROMPT * 2, "max_tokens": 1}).json()
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
