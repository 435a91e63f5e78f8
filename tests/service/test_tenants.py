"""Tenants, over real HTTP with the openai SDK (issue 25): one tenant's prompts are a miss for another, named
prefixes are scoped to their tenant unless an admin publishes them (then every tenant hits them by name
only), leases end and are refreshed, and the paid APIs' cache fields (prompt_cache_key, its retention,
cache_write_tokens) work, with exact read and write counts."""
from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests

from tests.helpers.server import ServerThread, tiny_config

A, A2, B, C, ADMIN = "key-a", "key-a2", "key-b", "key-c", "key-admin"
BLOCK = 16
SECRET = "Customer 4821 asked about the invoice of March; their PIN is 4821 and their plan is gold. " * 2


@pytest.fixture(scope="module")
def srv(tiny_llama_dir: Path) -> Iterator[ServerThread]:
    s = ServerThread(tiny_config(tiny_llama_dir, api_key=(B, C), admin_key=(ADMIN,), tenant_keys=(f"acme:{A}",
                                 f"acme:{A2}"), max_prefixes_per_tenant=3, prompt_cache_ttl=2.0,
                                 max_lease_seconds=90000.0)).start()
    try:
        yield s
    finally:
        s.stop()


def client(srv: ServerThread, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{srv.url}/v1", api_key=key, max_retries=0)


def complete(srv: ServerThread, key: str, prompt: str, max_tokens: int = 1, **extra: Any) -> dict[str, int]:
    """The prompt token details of one completion: cached_tokens, cache_write_tokens, and prompt_tokens."""
    out = client(srv, key).completions.create(model="llama", prompt=prompt, max_tokens=max_tokens,
                                              temperature=0, extra_body=extra or None)
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    details = out.usage.prompt_tokens_details
    assert details.cached_tokens is not None and details.cache_write_tokens is not None
    return {"cached": details.cached_tokens, "written": details.cache_write_tokens, "prompt": out.usage.prompt_tokens}


def api(srv: ServerThread, method: str, path: str, key: str, body: dict | None = None) -> requests.Response:
    return requests.request(method, f"{srv.url}{path}", json=body, timeout=60,
                            headers={"Authorization": f"Bearer {key}"})


def names(srv: ServerThread, key: str) -> list[str]:
    resp = api(srv, "GET", "/v1/prefixes", key)
    assert resp.status_code == 200, resp.text
    return sorted(p["name"] for p in resp.json()["data"])


def full(n: int) -> int:
    return n // BLOCK * BLOCK


def test_one_tenants_prompt_is_a_miss_for_another_and_a_hit_within_it(srv: ServerThread) -> None:
    prompt = "Tenant isolation, first case. " + SECRET
    first = complete(srv, A, prompt)
    assert first["cached"] == 0 and first["written"] == full(first["prompt"])       # exact write count
    assert complete(srv, B, prompt) == {**first, "cached": 0}       # B misses, and writes its own copy
    again = complete(srv, A2, prompt)                                # A2 is A's tenant (acme): a hit
    assert again["cached"] == full(first["prompt"] - 1) and again["written"] == first["written"] - again["cached"]
    assert complete(srv, C, prompt)["cached"] == 0
    # a client's cache_salt narrows within its tenant, never widens across
    assert complete(srv, A, prompt, cache_salt="session-1")["cached"] == 0
    assert complete(srv, A, prompt, cache_salt="session-1")["cached"] == again["cached"]
    assert complete(srv, B, prompt, cache_salt="session-1")["cached"] == 0


def test_named_prefixes_belong_to_their_tenant(srv: ServerThread) -> None:
    body = {"name": "mine", "prompt": "Tenant A's own system prompt. " + SECRET}
    resp = api(srv, "POST", "/v1/prefixes", A, body)
    assert resp.status_code == 201 and resp.json()["published"] is False and resp.json()["owner"] == "acme"
    try:
        assert "mine" in names(srv, A) and "mine" in names(srv, A2) and "mine" not in names(srv, B)
        assert api(srv, "GET", "/v1/prefixes/mine", B).status_code == 404
        assert api(srv, "DELETE", "/v1/prefixes/mine", B).status_code == 404
        with pytest.raises(openai.NotFoundError):
            complete(srv, B, " Hi?", prefix="mine")
        hit = complete(srv, A2, " Hi?", prefix="mine")
        assert hit["cached"] == full(hit["prompt"] - 3) > 0
        # A's own unnamed prompt with the same text hits its prefix (same tenant, same salt); B's misses
        assert complete(srv, A, body["prompt"] + " Hi?")["cached"] >= hit["cached"]
        assert complete(srv, B, body["prompt"] + " Hi?")["cached"] == 0
        # B may hold its own prefix of the same name; each tenant sees its own
        other = api(srv, "POST", "/v1/prefixes", B, {"name": "mine", "prompt": "B's prompt. " + SECRET[:80]})
        assert other.status_code == 201
        assert api(srv, "GET", "/v1/prefixes/mine", B).json()["num_tokens"] == other.json()["num_tokens"]
        assert api(srv, "GET", "/v1/prefixes/mine", A).json()["num_tokens"] == resp.json()["num_tokens"]
        # an admin sees both, names either with ?tenant=, and sees whose
        every = api(srv, "GET", "/v1/prefixes", ADMIN).json()["data"]
        owners = sorted(p["owner"] for p in every if p["name"] == "mine")
        assert owners[0] == "acme" and owners[1].startswith("key.") and B not in str(every)
        assert api(srv, "DELETE", f"/v1/prefixes/mine?tenant={owners[1]}", ADMIN).status_code == 200
        assert api(srv, "GET", "/v1/prefixes/mine", B).status_code == 404
        assert api(srv, "GET", "/v1/prefixes/mine?tenant=acme", B).status_code == 403
    finally:
        api(srv, "DELETE", "/v1/prefixes/mine", A)
    assert "mine" not in names(srv, A)


def test_a_published_prefix_hits_for_every_tenant_by_name_only(srv: ServerThread) -> None:
    text = "The operator's published system prompt, shared by name. " + SECRET
    resp = api(srv, "POST", "/v1/prefixes", ADMIN, {"name": "shared-sys", "prompt": text})
    assert resp.status_code == 201 and resp.json()["published"] is True
    try:
        for key in (A, B, C):
            named = complete(srv, key, " What now?", prefix="shared-sys")
            assert named["cached"] == resp.json()["num_pinned_blocks"] * BLOCK
        for key in (A, B, ADMIN):                                     # its text, unnamed: a miss for all
            assert complete(srv, key, text + " What now?")["cached"] == 0
        assert api(srv, "DELETE", "/v1/prefixes/shared-sys", B).status_code == 403
        assert api(srv, "PATCH", "/v1/prefixes/shared-sys", B, {"description": "x"}).status_code == 403
        denied = api(srv, "POST", "/v1/prefixes", B, {"name": "pub", "prompt": text, "published": True})
        assert denied.status_code == 403 and denied.json()["error"]["param"] == "published"
    finally:
        assert api(srv, "DELETE", "/v1/prefixes/shared-sys", ADMIN).status_code == 200


def test_what_follows_a_published_prefix_is_not_shared_across_tenants(srv: ServerThread) -> None:
    resp = api(srv, "POST", "/v1/prefixes", ADMIN, {"name": "sys2", "prompt": "Published again. " + SECRET})
    assert resp.status_code == 201
    pinned = resp.json()["num_pinned_blocks"] * BLOCK
    question = " My own question, long enough to fill blocks of its own, about an invoice of April. " * 2
    try:
        first = complete(srv, A, question, prefix="sys2")
        assert first["cached"] == pinned and first["written"] > 0
        assert complete(srv, B, question, prefix="sys2")["cached"] == pinned        # only the prefix
        assert complete(srv, A2, question, prefix="sys2")["cached"] > pinned         # A's tenant: all of it
    finally:
        api(srv, "DELETE", "/v1/prefixes/sys2", ADMIN)


def test_leases_end_unless_hit_and_can_be_changed(srv: ServerThread) -> None:
    body = {"name": "leased", "prompt": "A leased prompt. " + SECRET, "ttl_seconds": 3}
    resp = api(srv, "POST", "/v1/prefixes", A, body)
    assert resp.status_code == 201 and resp.json()["ttl_seconds"] == 3 and resp.json()["expires_at"] is not None
    for _ in range(3):                                # hits keep it: 3 x 1.4 s > its 3 s lease
        time.sleep(1.4)
        assert complete(srv, A, " Still there?", prefix="leased")["cached"] > 0
    patched = api(srv, "PATCH", "/v1/prefixes/leased", A, {"ttl_seconds": 1, "description": "short"})
    assert patched.status_code == 200 and patched.json()["description"] == "short"
    deadline = time.monotonic() + 10
    while "leased" in names(srv, A) and time.monotonic() < deadline:
        time.sleep(0.3)
    assert "leased" not in names(srv, A)
    assert api(srv, "GET", "/v1/prefixes/leased", A).status_code == 404
    keep = api(srv, "POST", "/v1/prefixes", A, {**body, "name": "kept"})
    assert api(srv, "PATCH", "/v1/prefixes/kept", A, {"ttl_seconds": None}).json()["expires_at"] is None
    time.sleep(3)
    assert "kept" in names(srv, A) and keep.status_code == 201
    api(srv, "DELETE", "/v1/prefixes/kept", A)


@pytest.mark.parametrize("body, param", [
    ({"name": "x", "prompt": SECRET, "ttl_seconds": 0}, "ttl_seconds"),
    ({"name": "x", "prompt": SECRET, "ttl_seconds": 10 ** 9}, "ttl_seconds"),
    ({"name": "x", "prompt": SECRET, "ttl": 5}, "ttl"),
])
def test_bad_lease_fields_are_400s(srv: ServerThread, body: dict, param: str) -> None:
    resp = api(srv, "POST", "/v1/prefixes", A, body)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param


def test_the_per_tenant_cap_is_a_507(srv: ServerThread) -> None:
    made = []
    try:
        for i in range(4):
            resp = api(srv, "POST", "/v1/prefixes", C, {"name": f"cap{i}", "prompt": f"Prefix {i}. " + SECRET})
            if resp.status_code == 201:
                made.append(f"cap{i}")
        assert len(made) == 3 and resp.status_code == 507 and "max-prefixes-per-tenant" in resp.text
        assert api(srv, "POST", "/v1/prefixes", B, {"name": "cap9", "prompt": "B. " + SECRET}).status_code == 201
        api(srv, "DELETE", "/v1/prefixes/cap9", B)
    finally:
        for name in made:
            api(srv, "DELETE", f"/v1/prefixes/{name}", C)


def test_prompt_cache_key_leases_the_common_prefix(srv: ServerThread) -> None:
    system = "An agent's long instructions, resent with every turn of the conversation. " + SECRET
    warm = client(srv, B).completions.create(model="llama", prompt=system + " Turn one.", max_tokens=0,
                                             extra_body={"prompt_cache_key": "agent-7"})
    assert warm.usage is not None and warm.usage.prompt_tokens_details is not None
    assert warm.usage.completion_tokens == 0
    assert warm.usage.prompt_tokens_details.cache_write_tokens == full(warm.usage.prompt_tokens)
    lease = [p for p in api(srv, "GET", "/v1/prefixes", B).json()["data"] if p["type"] == "prompt_cache_key"]
    assert len(lease) == 1 and lease[0]["num_tokens"] == full(warm.usage.prompt_tokens - 1)
    assert lease[0]["ttl_seconds"] == 2                  # in_memory: the server's prompt_cache_ttl
    second = complete(srv, B, system + " Turn two, another question.", prompt_cache_key="agent-7")
    assert second["cached"] > 0
    lease = [p for p in api(srv, "GET", "/v1/prefixes", B).json()["data"] if p["type"] == "prompt_cache_key"]
    assert len(lease) == 1 and lease[0]["num_tokens"] <= second["cached"]      # narrowed to what they share
    assert all(p["type"] != "prompt_cache_key" for p in api(srv, "GET", "/v1/prefixes", A).json()["data"])
    # the lease keeps the blocks pinned past their requests, and ends like any other
    deadline = time.monotonic() + 10
    while any(p["type"] == "prompt_cache_key" for p in api(srv, "GET", "/v1/prefixes", B).json()["data"]) \
            and time.monotonic() < deadline:
        time.sleep(0.3)
    assert not any(p["type"] == "prompt_cache_key" for p in api(srv, "GET", "/v1/prefixes", B).json()["data"])


def test_chat_takes_prompt_cache_key_and_24h_retention(srv: ServerThread) -> None:
    out = client(srv, C).chat.completions.create(
        model="llama", messages=[{"role": "system", "content": SECRET}, {"role": "user", "content": "Hi"}],
        max_tokens=2, prompt_cache_key="chat-24h", prompt_cache_retention="24h")
    assert out.usage is not None and out.usage.prompt_tokens_details is not None
    lease = [p for p in api(srv, "GET", "/v1/prefixes", C).json()["data"] if p["type"] == "prompt_cache_key"]
    assert len(lease) == 1 and lease[0]["ttl_seconds"] == 86400
    api(srv, "DELETE", f"/v1/prefixes/{lease[0]['name']}", C)


@pytest.mark.parametrize("extra, param", [
    ({"prompt_cache_key": "k" * 1025}, "prompt_cache_key"),
    ({"prompt_cache_key": ""}, "prompt_cache_key"),
    ({"prompt_cache_retention": "forever"}, "prompt_cache_retention"),
    ({"prompt_cache_options": {"ttl": "100h"}}, "prompt_cache_options"),
    ({"prompt_cache_options": {"ttl": "soon"}}, "prompt_cache_options"),
    ({"cache_salt": ""}, "cache_salt"),
])
def test_bad_cache_fields_are_400s(srv: ServerThread, extra: dict, param: str) -> None:
    resp = api(srv, "POST", "/v1/completions", A, {"model": "llama", "prompt": "Hi", "max_tokens": 1, **extra})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_metrics_do_not_show_a_tenants_prefix_names(srv: ServerThread) -> None:
    assert api(srv, "POST", "/v1/prefixes", A, {"name": "acme-secret-name", "prompt": SECRET}).status_code == 201
    try:
        complete(srv, A, " Hi", prefix="acme-secret-name")
        scrape = api(srv, "GET", "/metrics", B).text
        assert "acme-secret-name" not in scrape and 'prefix="private-' in scrape
    finally:
        api(srv, "DELETE", "/v1/prefixes/acme-secret-name", A)


def test_listings_come_in_pages_without_sources(srv: ServerThread) -> None:
    """Issue 24, item 8: a listing is a page (limit, after: OpenAI's list shape) of what the caller may see,
    without sources or block hashes, so no listing grows with what every tenant registered."""
    made = [f"page{i}" for i in range(3)]
    for name in made:
        resp = api(srv, "POST", "/v1/prefixes", B, {"name": name, "prompt": f"{name}. " + SECRET})
        assert resp.status_code == 201, (resp.text, names(srv, B))
    try:
        first = api(srv, "GET", "/v1/prefixes?limit=2", B).json()
        assert [p["name"] for p in first["data"]] == made[:2] and first["has_more"] is True
        assert all("source" not in p and "block_hashes" not in p for p in first["data"])
        rest = api(srv, "GET", f"/v1/prefixes?limit=2&after={first['last_id']}", B).json()
        assert [p["name"] for p in rest["data"]] == made[2:] and rest["has_more"] is False
        for bad in ("0", "1001", "x", "²"):
            resp = api(srv, "GET", f"/v1/prefixes?limit={bad}", B)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "limit"
        # the render of a prompt naming its own prefix does not show the server's cache salt
        render = api(srv, "POST", "/v1/completions/render", B, {"model": "llama", "prompt": " Hi", "prefix": "page0"})
        assert render.status_code == 200 and "cache_salt" not in render.text and "tenant:" not in render.text
    finally:
        for name in made:
            api(srv, "DELETE", f"/v1/prefixes/{name}", B)
