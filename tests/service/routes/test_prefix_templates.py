"""Named prefixes compose at the chat-template level: a chat request naming a prefix registered with
messages gets exactly the tokens (and so the greedy output) of the same conversation sent inline, with
the pinned blocks hit; what cannot compose is refused with a 400."""
from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers.server import ServerThread, http, tiny_config

SYSTEM = "You are Acme support. Answer in one short sentence and name the product. " * 4
# A template that, like SmolLM2's and Qwen2's, adds a default system prompt when the conversation has none.
DEFAULT_SYSTEM_TEMPLATE = (
    "{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
    "<|im_start|>system\nYou are a default assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# One that renders a lone message differently from the same message followed by others.
ALONE_TEMPLATE = (
    "{% if messages|length == 1 %}ALONE {% endif %}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def srv(tiny_llama_dir: Path) -> Iterator[ServerThread]:
    s = ServerThread(tiny_config(tiny_llama_dir, max_model_len=512, chat_template=DEFAULT_SYSTEM_TEMPLATE)).start()
    yield s
    s.stop()


def chat(srv: ServerThread, **body: Any) -> dict:
    status, out = http("POST", f"{srv.url}/v1/chat/completions",
                       {"max_tokens": 8, "temperature": 0, "return_token_ids": True, **body})
    assert status == 200, out
    return out


def test_named_prefix_equals_the_inline_conversation(srv: ServerThread) -> None:
    status, rec = http("POST", f"{srv.url}/v1/prefixes", {"name": "acme", "messages": [
        {"role": "system", "content": SYSTEM}]})
    assert status == 201 and rec["num_pinned_blocks"] >= 4, rec
    user = [{"role": "user", "content": "Where is my order?"}]
    named = chat(srv, prefix="acme", messages=user)
    inline = chat(srv, messages=[{"role": "system", "content": SYSTEM}, *user])
    assert named["prompt_token_ids"] == inline["prompt_token_ids"]
    assert named["choices"][0]["token_ids"] == inline["choices"][0]["token_ids"]
    text = srv.state.engine.tokenizer.decode(named["prompt_token_ids"])  # type: ignore[union-attr]
    assert text.count("<|im_start|>system") == 1 and "default assistant" not in text
    assert named["usage"]["prompt_tokens_details"]["cached_tokens"] >= rec["num_pinned_blocks"] * 16
    assert http("DELETE", f"{srv.url}/v1/prefixes/acme")[0] == 200


def test_a_completion_after_a_prefix_adds_no_special_tokens(srv: ServerThread) -> None:
    status, rec = http("POST", f"{srv.url}/v1/prefixes", {"name": "acme-p", "prompt": SYSTEM})
    assert status == 201
    status, out = http("POST", f"{srv.url}/v1/completions", {"prefix": "acme-p", "prompt": " Question: hi?",
                                                              "max_tokens": 2, "return_token_ids": True})
    assert status == 200, out
    tok = srv.state.engine.tokenizer  # type: ignore[union-attr]
    head = tok.encode(SYSTEM)
    assert out["prompt_token_ids"][0] == head + tok.encode(" Question: hi?", add_special_tokens=False)
    assert out["usage"]["prompt_tokens_details"]["cached_tokens"] == rec["num_pinned_blocks"] * 16
    status, err = http("POST", f"{srv.url}/v1/chat/completions", {"prefix": "acme-p",
                                                                   "messages": [{"role": "user", "content": "hi"}]})
    assert status == 400 and err["error"]["param"] == "prefix"          # a prompt cannot start a conversation
    assert http("DELETE", f"{srv.url}/v1/prefixes/acme-p")[0] == 200


def test_registrations_that_would_pin_nothing_or_never_hit_are_refused(srv: ServerThread,
                                                                        tiny_llama_dir: Path) -> None:
    status, err = http("POST", f"{srv.url}/v1/prefixes", {"name": "short", "prompt": "Be brief."})
    assert status == 400 and "less than one KV block" in err["error"]["message"]
    alone = ServerThread(tiny_config(tiny_llama_dir, chat_template=ALONE_TEMPLATE)).start()
    try:
        status, err = http("POST", f"{alone.url}/v1/prefixes", {"name": "sys", "messages": [
            {"role": "system", "content": SYSTEM}]})
        assert status == 400 and err["error"]["param"] == "messages", err
    finally:
        alone.stop()
