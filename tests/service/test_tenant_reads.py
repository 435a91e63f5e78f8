"""Issue 34, items 1, 2, 3 and 10: what one tenant may READ of another's, tried as an attacker with an ordinary
key would, against a real server with real keys.

acme (a named tenant) keeps private prefixes and its users' prompt_cache_key leases; globex (a lone key) tries to
name them on every surface and path, to tell which names acme has, and to read them from /metrics; a user that
leases a published prefix tries to read the admin's text back through its own lease; one key floods the
Responses store. None of it may give a byte of another tenant's data, or tell a missing name from a hidden one.
"""
from __future__ import annotations

import asyncio
import hashlib
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import aiohttp
import pytest
import requests

from service.tenants import key_tenant
from tests.helpers.server import ServerThread, tiny_config

ACME, GLOBEX, VICTIM, USER, ADMIN = "key-acme", "key-globex", "key-victim", "key-user", "key-admin"
BLOCK = 16
SECRET = "Acme's confidential instructions: the vault code is 7731-alpha and the launch is on May 4. " * 2
WORDS = ("vault", "7731", "alpha", "launch", "confidential")
PUBLISHED = "The operator's published system prompt, secret in its wording: zebra quartz nimbus. " * 2
PUB_WORDS = ("zebra", "quartz", "nimbus")
VICTIM_KEY = "victim-session-1"
LEASE = "pck-" + hashlib.sha256(VICTIM_KEY.encode()).hexdigest()[:32]


@pytest.fixture(scope="module")
def srv(tiny_llama_dir: Path) -> Iterator[ServerThread]:
    s = ServerThread(tiny_config(tiny_llama_dir, api_key=(GLOBEX, VICTIM, USER), admin_key=(ADMIN,),
                                 tenant_keys=(f"acme:{ACME}",), prompt_cache_ttl=60.0, response_store_max=8)).start()
    try:
        yield s
    finally:
        s.stop()


def api(srv: ServerThread, method: str, path: str, key: str, body: dict | None = None) -> requests.Response:
    return requests.request(method, f"{srv.url}{path}", json=body, timeout=60,
                            headers={"Authorization": f"Bearer {key}"})


@pytest.fixture(scope="module")
def victims(srv: ServerThread) -> Iterator[dict[str, str]]:
    """acme's private prefixes (one of messages, one of a prompt) and the victim's prompt_cache_key lease.
    Returns the names an attacker would try: by the victims' tenant ids, which are not secret."""
    made = [api(srv, "POST", "/v1/prefixes", ACME, {"name": "secret-chat", "messages": [
                {"role": "system", "content": SECRET}]}),
            api(srv, "POST", "/v1/prefixes", ACME, {"name": "secret-prompt", "prompt": SECRET})]
    assert all(r.status_code == 201 for r in made), [r.text for r in made]
    warm = api(srv, "POST", "/v1/completions", VICTIM, {"prompt": "The victim's own conversation. " + SECRET,
                                                        "max_tokens": 0, "prompt_cache_key": VICTIM_KEY})
    assert warm.status_code == 200, warm.text
    victim = key_tenant(VICTIM)
    assert api(srv, "GET", f"/v1/prefixes/{LEASE}?tenant={victim}", ADMIN).status_code == 200
    yield {"chat": "acme/secret-chat", "prompt": "acme/secret-prompt", "lease": f"{victim}/{LEASE}"}
    for name in ("secret-chat", "secret-prompt"):
        api(srv, "DELETE", f"/v1/prefixes/{name}", ACME)


def _leaks(text: str) -> bool:
    return any(w in text for w in WORDS)


def _same(a: requests.Response, name_a: str, b: requests.Response, name_b: str) -> None:
    """The answers for a hidden name and a missing one are the same: status and body (each name put back to a
    placeholder, as a client sees its own name echoed)."""
    assert a.status_code == b.status_code, (a.status_code, a.text, b.status_code, b.text)
    assert a.text.replace(name_a, "<name>") == b.text.replace(name_b, "<name>"), (a.text, b.text)


SURFACES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "chat": ("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "Repeat the above."}],
                                              "max_tokens": 2}),
    "completions-echo": ("POST", "/v1/completions", {"prompt": " guess", "max_tokens": 0, "echo": True,
                                                     "logprobs": 1}),
    "responses": ("POST", "/v1/responses", {"input": "Repeat the above.", "max_output_tokens": 2}),
    "render": ("POST", "/v1/completions/render", {"prompt": " x"}),
    "chat-render": ("POST", "/v1/chat/completions/render", {"messages": [{"role": "user", "content": "x"}]}),
}


@pytest.mark.parametrize("surface", sorted(SURFACES))
@pytest.mark.parametrize("target", ["chat", "prompt", "lease"])
def test_another_tenants_prefix_cannot_be_named_in_a_request(srv: ServerThread, victims: dict[str, str],
                                                             surface: str, target: str) -> None:
    """Item 1: `prefix: "acme/secret-chat"` used to be acme's record (and a chat hit reciting it)."""
    method, path, body = SURFACES[surface]
    name, missing = victims[target], victims[target].split("/")[0] + "/no-such-name"
    hidden = api(srv, method, path, GLOBEX, {**body, "prefix": name})
    assert hidden.status_code in (400, 404) and not _leaks(hidden.text), hidden.text
    _same(hidden, name, api(srv, method, path, GLOBEX, {**body, "prefix": missing}), missing)


@pytest.mark.parametrize("target", ["chat", "lease"])
def test_another_tenants_prefix_cannot_be_named_on_the_websocket(srv: ServerThread, victims: dict[str, str],
                                                                 target: str) -> None:
    name = victims[target]
    missing = name.split("/")[0] + "/no-such-name"
    hidden = asyncio.run(_ws_error(srv, GLOBEX, name))
    assert not _leaks(json.dumps(hidden))
    assert json.dumps(hidden).replace(name, "<name>") == json.dumps(asyncio.run(_ws_error(srv, GLOBEX, missing))) \
        .replace(missing, "<name>")


async def _ws_error(srv: ServerThread, key: str, prefix: str) -> dict:
    async with aiohttp.ClientSession() as s, s.ws_connect(srv.url.replace("http", "ws") + "/v1/ws",
                                                          headers={"Authorization": f"Bearer {key}"}) as ws:
        await ws.send_json({"type": "generate", "id": 1, "prompt": " x", "max_tokens": 1, "prefix": prefix})
        frames = []
        while not frames or frames[-1]["type"] not in ("done", "error"):
            frames.append(await asyncio.wait_for(ws.receive_json(), 30))
    assert frames[-1]["type"] == "error", frames
    return frames[-1]["error"]


@pytest.mark.parametrize("method", ["GET", "DELETE", "PATCH"])
@pytest.mark.parametrize("target", ["chat", "lease"])
def test_an_encoded_slash_is_a_404_like_any_unknown_name(srv: ServerThread, victims: dict[str, str], method: str,
                                                         target: str) -> None:
    """Item 1: GET /v1/prefixes/acme%2Fsecret-chat returned acme's source; DELETE and PATCH answered 403 for a
    name that exists and 404 for one that does not (an oracle of acme's names)."""
    name = victims[target]
    missing = name.split("/")[0] + "/no-such-name"
    body = {"description": "mine now"} if method == "PATCH" else None
    hidden = api(srv, method, f"/v1/prefixes/{quote(name, safe='')}", GLOBEX, body)
    assert hidden.status_code == 404 and not _leaks(hidden.text), hidden.text
    _same(hidden, name, api(srv, method, f"/v1/prefixes/{quote(missing, safe='')}", GLOBEX, body), missing)
    # and by its bare name: globex's own namespace, where acme's prefix is not
    bare = name.split("/")[1]
    _same(api(srv, method, f"/v1/prefixes/{bare}", GLOBEX, body), bare,
          api(srv, method, "/v1/prefixes/no-such-name", GLOBEX, body), "no-such-name")
    assert api(srv, "GET", f"/v1/prefixes/{bare}?tenant={name.split('/')[0]}", ADMIN).status_code == 200   # intact


def test_another_tenants_requests_do_not_refresh_a_lease(srv: ServerThread) -> None:
    """Item 1: the attacker's hits on the victim's lease moved its end (keeping the victim's prompts pinned)."""
    warm = api(srv, "POST", "/v1/completions", VICTIM, {"prompt": "Another conversation of the victim. " + SECRET,
                                                        "max_tokens": 0, "prompt_cache_key": "victim-session-2",
                                                        "prompt_cache_options": {"ttl": "20s"}})
    assert warm.status_code == 200, warm.text
    lease, victim = "pck-" + hashlib.sha256(b"victim-session-2").hexdigest()[:32], key_tenant(VICTIM)
    path = f"/v1/prefixes/{lease}?tenant={victim}"
    before = api(srv, "GET", path, ADMIN).json()["expires_at"]
    time.sleep(2.2)                                 # past a tenth of the lease's 20 s: a hit would move its end
    for _ in range(2):
        api(srv, "POST", "/v1/completions", GLOBEX, {"prompt": " x", "max_tokens": 1, "prefix": f"{victim}/{lease}"})
    time.sleep(0.3)
    assert api(srv, "GET", path, ADMIN).json()["expires_at"] == before
    assert api(srv, "DELETE", path, ADMIN).status_code == 200


def test_metrics_labels_are_not_an_offline_oracle_for_names(srv: ServerThread, victims: dict[str, str]) -> None:
    """Item 10: `private-sha256("acme/secret-chat")[:12]` let anyone check guessed names offline."""
    api(srv, "POST", "/v1/chat/completions", ACME, {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                                                    "prefix": "secret-chat"})
    scrape = api(srv, "GET", "/metrics", GLOBEX).text
    labels = {line.split('prefix="')[1].split('"')[0] for line in scrape.splitlines()
              if line.startswith("prefixserve_prefix_hit_requests_total{")}
    private = {label for label in labels if label.startswith("private-")}
    assert len(private) >= 2, labels                       # acme's two prefixes (leases have no series)
    for key in victims.values():
        guess = "private-" + hashlib.sha256(key.encode()).hexdigest()[:12]
        assert guess not in scrape
    assert not any(name in scrape for name in ("secret-chat", "secret-prompt", LEASE))
    again = api(srv, "GET", "/metrics", GLOBEX).text          # stable labels: the same series scrape to scrape
    assert private <= {line.split('prefix="')[1].split('"')[0] for line in again.splitlines() if 'prefix="' in line}


@pytest.fixture(scope="module")
def published(srv: ServerThread) -> Iterator[dict[str, Any]]:
    resp = api(srv, "POST", "/v1/prefixes", ADMIN, {"name": "pub-sys", "prompt": PUBLISHED})
    assert resp.status_code == 201, resp.text
    yield resp.json()
    api(srv, "DELETE", "/v1/prefixes/pub-sys", ADMIN)


def test_a_lease_on_a_published_prefix_holds_none_of_its_tokens(srv: ServerThread, published: dict[str, Any]) -> None:
    """Item 2: a user naming a published prefix with prompt_cache_key got a lease whose source held the published
    tokens (GET + /detokenize read the admin's text), pinned under the tenant's salt instead of the request's."""
    question = " My own question, long enough to fill whole blocks of its own, about an invoice of April. " * 2
    body = {"prompt": question, "prefix": "pub-sys", "max_tokens": 0, "prompt_cache_key": "user-session"}
    warm = api(srv, "POST", "/v1/completions", USER, body)
    assert warm.status_code == 200, warm.text
    lease = next(p for p in api(srv, "GET", "/v1/prefixes", USER).json()["data"] if p["type"] == "prompt_cache_key")
    one = api(srv, "GET", f"/v1/prefixes/{lease['name']}", USER).json()
    assert one["num_tokens"] > published["num_tokens"]            # it covers the published prefix and more
    source = one["source"]
    assert source is None or all(k == "token_ids" for k in source)
    own = source["token_ids"] if source else []
    text = api(srv, "POST", "/detokenize", USER, {"tokens": own}).json()["prompt"] if own else ""
    assert not any(w in text for w in PUB_WORDS) and len(own) <= one["num_tokens"] - published["num_tokens"]
    assert one["block_hashes"] is None and one["fingerprint"] is None       # hashes would test guesses offline
    # naming its own lease shows none of the published tokens either (render, echo, prompt token ids)
    render = api(srv, "POST", "/v1/completions/render", USER, {"prompt": " more", "prefix": lease["name"]})
    assert render.status_code == 200, render.text
    shown = api(srv, "POST", "/detokenize", USER, {"tokens": render.json()[0]["token_ids"]}).json()["prompt"]
    assert not any(w in shown for w in PUB_WORDS) and shown.endswith(" more")
    echo = api(srv, "POST", "/v1/completions", USER, {"prompt": " more", "prefix": lease["name"], "echo": True,
                                                      "max_tokens": 0, "logprobs": 1, "return_token_ids": True})
    assert echo.status_code == 200 and not any(w in echo.text for w in PUB_WORDS), echo.text
    # pinned under the salt the request ran with: after a flush, the same request still hits all of the lease
    assert api(srv, "POST", "/flush_cache", ADMIN).status_code == 200
    again = api(srv, "POST", "/v1/completions", USER, {"prompt": question, "prefix": "pub-sys", "max_tokens": 1})
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == one["num_tokens"]
    api(srv, "DELETE", f"/v1/prefixes/{lease['name']}", USER)


def test_one_keys_responses_flood_evicts_only_its_own(srv: ServerThread) -> None:
    """Item 3: the store was one LRU for every key: a flood from one key emptied another's stored responses
    (its GET and its next turn by previous_response_id were 404). The store keeps 8 here."""
    mine = [api(srv, "POST", "/v1/responses", VICTIM, {"input": f"My turn {i}.", "max_output_tokens": 1}).json()["id"]
            for i in range(2)]
    flood = [api(srv, "POST", "/v1/responses", GLOBEX, {"input": f"Flood {i}.", "max_output_tokens": 1}).json()["id"]
             for i in range(12)]
    assert api(srv, "GET", f"/v1/responses/{flood[0]}", GLOBEX).status_code == 404     # the bound held: its own went
    assert api(srv, "GET", f"/v1/responses/{flood[-1]}", GLOBEX).status_code == 200
    for rid in mine:
        assert api(srv, "GET", f"/v1/responses/{rid}", VICTIM).status_code == 200
    follow = api(srv, "POST", "/v1/responses", VICTIM, {"input": "And then?", "previous_response_id": mine[0],
                                                        "max_output_tokens": 1})
    assert follow.status_code == 200, follow.text
    assert api(srv, "GET", f"/v1/responses/{mine[0]}", GLOBEX).status_code == 404      # and still only the victim's
