"""With keys: cache_control leases are the caller's tenant's (another tenant's identical prompt is neither a read
nor a write of them), both key headers work, errors keep Anthropic's shape; the miss diagnosis on /v1/messages
(diagnostics.previous_message_id) and the Responses API (prompt_cache_options.comparison_response_id) names the
first difference and the exact tokens missed, and never shows another key's requests; the Responses pre-warm."""
from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import pytest
from openai import OpenAI

from tests.helpers.server import ServerThread, fresh_system_prompt, http, tiny_config

A, B, ADMIN = "key-a-anthropic", "key-b-anthropic", "key-admin-anthropic"
BLOCK = 16


@pytest.fixture(scope="module")
def keyed(tiny_llama_dir: Path) -> Iterator[ServerThread]:
    s = ServerThread(tiny_config(tiny_llama_dir, api_key=(A, B), admin_key=(ADMIN,))).start()
    yield s
    s.stop()


def _client(server: ServerThread, key: str, bearer: bool = False) -> anthropic.Anthropic:
    if bearer:      # Authorization: Bearer, as the OpenAI clients send it
        return anthropic.Anthropic(base_url=server.url, auth_token=key, api_key=None, max_retries=0, timeout=60)
    return anthropic.Anthropic(base_url=server.url, api_key=key, max_retries=0, timeout=60)


def _tokens(server: ServerThread, messages: list[dict[str, Any]]) -> list[int]:
    status, out = http("POST", f"{server.url}/tokenize", {"messages": messages},
                       headers={"Authorization": f"Bearer {ADMIN}"})
    assert status == 200, out
    return list(out["tokens"])


def _missed(prev: list[int], cur: list[int]) -> int:
    """The diagnosis' count, from the token ids: of the earlier prompt's full blocks this one could have read,
    those from the first block that differs."""
    would = min(len(prev) // BLOCK * BLOCK, (len(cur) - 1) // BLOCK * BLOCK)
    common = next((i for i, (x, y) in enumerate(zip(prev, cur)) if x != y), min(len(prev), len(cur)))
    return max(0, would - common // BLOCK * BLOCK)


def test_keys_in_either_header_and_errors_in_anthropics_shape(keyed: ServerThread) -> None:
    model = keyed.state.model_name
    for c in (_client(keyed, A), _client(keyed, B, bearer=True)):
        assert c.messages.create(model=model, max_tokens=1, messages=[{"role": "user", "content": "hi"}]).content
    status, out = http("POST", f"{keyed.url}/v1/messages", {"model": model, "max_tokens": 1,
                                                           "messages": [{"role": "user", "content": "hi"}]})
    assert status == 401 and out["type"] == "error" and out["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.AuthenticationError):
        _client(keyed, "wrong").messages.create(model=model, max_tokens=1, messages=[{"role": "user", "content": "x"}])


def test_another_tenants_identical_prompt_neither_reads_nor_writes_the_first(keyed: ServerThread) -> None:
    model = keyed.state.model_name
    system: Any = [{"type": "text", "text": fresh_system_prompt(), "cache_control": {"type": "ephemeral"}}]
    ask: Any = [{"role": "user", "content": "Hello"}]
    a, b = _client(keyed, A), _client(keyed, B)
    first = a.messages.create(model=model, max_tokens=1, system=system, messages=ask).usage
    assert first.cache_creation_input_tokens and first.cache_creation_input_tokens >= 2 * BLOCK

    def leases(key: str) -> dict[str, Any]:
        status, out = http("GET", f"{keyed.url}/v1/prefixes?limit=1000", headers={"x-api-key": key})
        assert status == 200
        return {p["name"]: p for p in out["data"] if p["type"] == "cache_control"}
    mine = leases(A)
    other = b.messages.create(model=model, max_tokens=1, system=system, messages=ask).usage
    assert other.cache_read_input_tokens == 0                                  # not a read of A's entry
    assert other.cache_creation_input_tokens == first.cache_creation_input_tokens     # its own write
    assert leases(A) == mine                                                   # A's lease untouched
    assert set(leases(B)).isdisjoint(mine)
    again = a.messages.create(model=model, max_tokens=1, system=system, messages=ask).usage
    assert again.cache_read_input_tokens and again.cache_read_input_tokens >= first.cache_creation_input_tokens


def _diag(c: anthropic.Anthropic, model: str, system: str, messages: Any, previous: str | None,
          **kw: Any) -> Any:
    return c.messages.create(model=model, max_tokens=1, system=system, messages=messages,
                             diagnostics={"previous_message_id": previous}, **kw)


def test_messages_cache_miss_reason(keyed: ServerThread) -> None:
    model = keyed.state.model_name
    a, b = _client(keyed, A), _client(keyed, B)
    system = fresh_system_prompt()
    turns: Any = [{"role": "user", "content": "First question about rule3"},
                  {"role": "assistant", "content": "Rule3 applies."},
                  {"role": "user", "content": "And rule5?"}]
    first = _diag(a, model, system, turns, None)
    assert first.diagnostics is None                                           # opted in, nothing to compare
    same = _diag(a, model, system, turns + [{"role": "assistant", "content": "Yes."},
                                            {"role": "user", "content": "Thanks"}], first.id)
    assert same.diagnostics is None and same.usage.cache_read_input_tokens        # appended turns: all read

    chat = [{"role": "system", "content": system}] + turns
    changed = system.replace("rule7", "rule8")
    sys_miss = _diag(a, model, changed, turns, first.id)
    reason = sys_miss.diagnostics.cache_miss_reason                            # type: ignore[union-attr]
    assert reason.type == "system_changed"
    assert reason.cache_missed_input_tokens == _missed(_tokens(keyed, chat), _tokens(
        keyed, [{"role": "system", "content": changed}] + turns)) > 0

    edited = [dict(turns[0], content="First question about rule4"), *turns[1:]]
    msg_miss = _diag(a, model, system, edited, first.id)
    reason = msg_miss.diagnostics.cache_miss_reason                            # type: ignore[union-attr]
    assert reason.type == "messages_changed" and reason.message_index == 0      # type: ignore[attr-defined]
    assert reason.cache_missed_input_tokens == _missed(_tokens(keyed, chat), _tokens(
        keyed, [{"role": "system", "content": system}] + edited)) > 0

    salted = _diag(a, model, system, turns, first.id, extra_body={"cache_salt": "another-salt"})
    reason = salted.diagnostics.cache_miss_reason                              # type: ignore[union-attr]
    assert reason.type == "cache_salt_changed" and reason.cache_missed_input_tokens > 0

    # another key's message is "not found", exactly as an id that never existed
    for c, rid in ((b, first.id), (a, "msg_" + "0" * 32)):
        reason = _diag(c, model, system, turns, rid).diagnostics.cache_miss_reason   # type: ignore[union-attr]
        assert reason.type == "previous_message_not_found" and set(reason.to_dict()) == {"type"}

    # the same prompt, its blocks dropped from the cache meanwhile: evicted, by how much
    base = _diag(a, model, system, turns, None)
    status, _ = http("POST", f"{keyed.url}/flush_cache", {}, headers={"Authorization": f"Bearer {ADMIN}"})
    assert status == 200
    gone = _diag(a, model, system, turns, base.id)
    reason = gone.diagnostics.cache_miss_reason                                # type: ignore[union-attr]
    assert reason.type == "cache_evicted"
    n = len(_tokens(keyed, chat))
    assert reason.cache_missed_input_tokens == (n - 1) // BLOCK * BLOCK - gone.usage.cache_read_input_tokens > 0


def test_responses_comparison_and_prewarm(keyed: ServerThread) -> None:
    model = keyed.state.model_name
    a = OpenAI(base_url=f"{keyed.url}/v1", api_key=A, max_retries=0, timeout=60)
    b = OpenAI(base_url=f"{keyed.url}/v1", api_key=B, max_retries=0, timeout=60)
    instructions = fresh_system_prompt()
    ask = "Which rule applies to refunds?"
    warm = a.responses.create(model=model, instructions=instructions, input=ask,
                              extra_body={"prompt_cache_options": {"prewarm": True, "ttl": "5m"}})
    assert warm.status == "completed" and warm.output == []
    written = warm.usage.input_tokens_details.cache_write_tokens               # type: ignore[union-attr]
    assert written and written % BLOCK == 0 and written >= 2 * BLOCK
    status, out = http("GET", f"{keyed.url}/v1/prefixes?limit=1000", headers={"x-api-key": A})
    assert any(p["type"] == "cache_control" and p["num_tokens"] == written and p["ttl_seconds"] == 300
               for p in out["data"])

    def compare(c: OpenAI, rid: str, instr: str) -> Any:
        r = c.responses.create(model=model, instructions=instr, input=ask, max_output_tokens=1,
                               extra_body={"prompt_cache_options": {"comparison_response_id": rid}})
        return r.to_dict()
    hit = compare(a, warm.id, instructions)
    assert hit["prompt_cache_diagnostics"] == {"type": "cache_hit"}
    assert hit["usage"]["input_tokens_details"]["cached_tokens"] >= written
    changed = instructions.replace("rule6", "rule9")
    miss = compare(a, warm.id, changed)["prompt_cache_diagnostics"]
    chat = [{"role": "system", "content": instructions}, {"role": "user", "content": ask}]
    expected = _missed(_tokens(keyed, chat), _tokens(keyed, [{"role": "system", "content": changed}, chat[1]]))
    assert miss == {"type": "cache_miss", "reason": "instructions_changed", "cache_missed_tokens": expected,
                    "comparison_reusable_tokens": miss["comparison_reusable_tokens"]} and expected > 0
    assert compare(b, warm.id, instructions)["prompt_cache_diagnostics"] == {"type": "comparison_response_not_found"}
    a.close()
    b.close()


def test_cached_tokens_is_always_present_on_the_openai_surfaces(keyed: ServerThread) -> None:
    """0 included (clients read it unconditionally): chat, completions, a stream's usage chunk, Responses."""
    model = keyed.state.model_name
    c = OpenAI(base_url=f"{keyed.url}/v1", api_key=A, max_retries=0, timeout=60)
    fresh = uuid.uuid4().hex
    chat = c.chat.completions.create(model=model, max_tokens=1, messages=[{"role": "user", "content": fresh}])
    assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
    assert chat.usage.prompt_tokens_details.cached_tokens == 0
    comp = c.completions.create(model=model, max_tokens=1, prompt="x" + uuid.uuid4().hex)
    assert comp.usage.prompt_tokens_details.cached_tokens == 0                 # type: ignore[union-attr]
    chunks = list(c.chat.completions.create(model=model, max_tokens=1, stream=True,
                                            stream_options={"include_usage": True},
                                            messages=[{"role": "user", "content": uuid.uuid4().hex}]))
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details.cached_tokens == 0  # type: ignore[union-attr]
    resp = c.responses.create(model=model, max_output_tokens=1, input=uuid.uuid4().hex)
    assert resp.usage.input_tokens_details.cached_tokens == 0                  # type: ignore[union-attr]
    c.close()
