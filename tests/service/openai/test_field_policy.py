"""The request field policy (service/openai/schema.py), through real HTTP and the openai SDK: every field of
the SDK's chat request types and the message fields clients echo back are accepted; unknown fields are
ignored and named (log line and X-Ignored-Fields), or refused by name with --strict-fields; wrong values of
known fields are still 400s naming the field; stream_options.continuous_usage_stats puts usage on every
chunk; vLLM's chat_template_kwargs and structured_outputs are honoured."""
from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import requests
from openai import OpenAI
from transformers import AutoTokenizer

from service.openai.pipeline import IGNORED_HEADER
from service.openai.render import render_messages
from tests.helpers.server import ServerThread

MSG = [{"role": "user", "content": "hi"}]


def _post(server: ServerThread, path: str, body: Any, stream: bool = False) -> requests.Response:
    return requests.post(server.url + path, json=body, timeout=60, stream=stream)


@pytest.fixture()
def strict(server: ServerThread) -> Iterator[ServerThread]:
    server.config.strict_fields = True
    try:
        yield server
    finally:
        server.config.strict_fields = False


def test_the_sdk_typed_fields_are_accepted_without_warning(client: OpenAI, model_name: str) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=model_name, messages=MSG, max_tokens=3, store=True, metadata={"team": "a"},  # type: ignore[arg-type]
        service_tier="auto", reasoning_effort="low", prompt_cache_key="k1", prompt_cache_retention="24h",
        verbosity="low", safety_identifier="user-1", modalities=["text"],
        prediction={"type": "content", "content": "hello"}, parallel_tool_calls=True, user="u",
        stream_options=None, extra_body={"priority": 3, "cache_prompt": True})
    assert raw.http_response.status_code == 200
    assert IGNORED_HEADER not in raw.headers
    assert raw.parse().choices[0].message.role == "assistant"


def test_an_answer_echoed_back_with_model_dump_is_accepted(client: OpenAI, model_name: str) -> None:
    first = client.chat.completions.create(model=model_name, messages=MSG, max_tokens=3)  # type: ignore[arg-type]
    echoed = first.choices[0].message.model_dump()
    assert "refusal" in echoed and "annotations" in echoed and "function_call" in echoed
    echoed["provider_specific_fields"] = {"x": 1}                # litellm's message objects carry this
    echoed["reasoning_content"] = None
    messages: list[Any] = [*MSG, echoed, {"role": "user", "content": "again"}]
    raw = client.chat.completions.with_raw_response.create(model=model_name, messages=messages, max_tokens=3)
    assert raw.http_response.status_code == 200 and IGNORED_HEADER not in raw.headers


@pytest.mark.parametrize("stream", [False, True])
def test_unknown_fields_are_ignored_and_named(server: ServerThread, stream: bool,
                                              caplog: pytest.LogCaptureFixture) -> None:
    body = {"messages": [{"role": "user", "content": "hi", "mood": "x"}], "max_tokens": 3, "temprature": 0,
            "stream": stream, "stream_options": {"include_usage": True, "shiny": 1} if stream else None,
            "bad,name\r\nX-Evil: 1": True}
    with caplog.at_level(logging.WARNING, logger="service.openai.pipeline"):
        r = _post(server, "/v1/chat/completions", body, stream=stream)
        text = r.text
    assert r.status_code == 200, text
    named = r.headers[IGNORED_HEADER].split(", ")
    assert "temprature" in named and "messages[0].mood" in named
    assert "X-Evil" not in r.headers and any(n.startswith("bad?name??X-Evil") for n in named)
    if stream:
        assert "stream_options.shiny" in named and text.rstrip().endswith("data: [DONE]")
    else:
        assert r.json()["choices"][0]["message"]["role"] == "assistant"
    assert any("temprature" in rec.getMessage() for rec in caplog.records)


def test_the_warning_names_a_bounded_number_of_fields(server: ServerThread) -> None:
    body = {"prompt": "hi", "max_tokens": 2, **{f"f{i}": i for i in range(500)}}
    r = _post(server, "/v1/completions", body)
    assert r.status_code == 200
    named = r.headers[IGNORED_HEADER].split(", ")
    assert len(named) == 17 and named[-1] == "(and 484 more)"


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hi", "max_token": 5}, "max_token"),
    ("/v1/chat/completions", {"messages": MSG, "temprature": 0}, "temprature"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "mood": "x"}]}, "messages"),
])
def test_strict_fields_refuses_unknown_fields_by_name(strict: ServerThread, path: str, body: dict,
                                                      param: str) -> None:
    r = _post(strict, path, body)
    assert r.status_code == 400
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and "unknown field" in err["message"] and err["param"] == param


def test_our_own_apis_refuse_unknown_fields_always(server: ServerThread) -> None:
    r = _post(server, "/v1/prefixes", {"name": "x", "prompt": "hello", "expires_in": 5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "expires_in"
    r = _post(server, "/tokenize", {"prompt": "hello", "add_bos": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "add_bos"


@pytest.mark.parametrize("field,value", [
    ("service_tier", "fastest"), ("reasoning_effort", "max"), ("modalities", ["text", "audio"]),
    ("audio", {"voice": "alloy", "format": "wav"}), ("metadata", {f"k{i}": "v" for i in range(17)}),
    ("prompt_cache_retention", "forever"), ("store", "yes"), ("echo", True),
    ("structured_outputs", {"grammar": "root ::= \"a\""}), ("chat_template_kwargs", {"tools": []}),
])
def test_wrong_values_of_known_fields_are_refused_by_name(server: ServerThread, field: str, value: Any) -> None:
    r = _post(server, "/v1/chat/completions", {"messages": MSG, "max_tokens": 2, field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field


def test_a_function_call_in_an_echoed_message_is_refused(server: ServerThread) -> None:
    msg = {"role": "assistant", "content": None, "function_call": {"name": "f", "arguments": "{}"}}
    r = _post(server, "/v1/chat/completions", {"messages": [*MSG, msg, *MSG], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"


def test_continuous_usage_stats_puts_usage_on_every_chunk(server: ServerThread) -> None:
    body = {"messages": MSG, "max_tokens": 6, "min_tokens": 6, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    r = _post(server, "/v1/chat/completions", body, stream=True)
    chunks = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    with_choices = [c for c in chunks if c["choices"]]
    assert with_choices and all(c.get("usage") for c in with_choices)
    done = [c["usage"]["completion_tokens"] for c in with_choices]
    assert done == sorted(done) and done[-1] == 6 and done[0] <= 1
    assert all(c["usage"]["prompt_tokens"] == chunks[-1]["usage"]["prompt_tokens"] for c in with_choices)
    assert not chunks[-1]["choices"] and chunks[-1]["usage"]["completion_tokens"] == 6
    plain = _post(server, "/v1/chat/completions", {**body, "stream_options": {"include_usage": True}}, stream=True)
    plain_chunks = [json.loads(line[6:]) for line in plain.text.splitlines() if line.startswith("data: {")]
    assert all(c.get("usage") is None for c in plain_chunks if c["choices"])   # null until the last, as OpenAI


def test_structured_outputs_choice_constrains_the_answer(client: OpenAI, model_name: str) -> None:
    out = client.chat.completions.create(model=model_name, messages=MSG, max_tokens=8,  # type: ignore[arg-type]
                                         extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert out.choices[0].message.content in ("yes", "no")


def test_chat_template_kwargs_reach_the_template(tiny_llama_dir: Path) -> None:
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                         "{% if greeting is defined %}[{{ greeting }}]{% endif %}")
    plain = render_messages([{"role": "user", "content": "hi"}], tok, add_generation_prompt=True)
    greeted = render_messages([{"role": "user", "content": "hi"}], tok, add_generation_prompt=True,
                              extra={"greeting": "hello"})
    assert tok.decode(greeted).endswith("[hello]") and not tok.decode(plain).endswith("]")


def test_chat_template_kwargs_on_a_request(client: OpenAI, model_name: str) -> None:
    out = client.chat.completions.create(model=model_name, messages=MSG, max_tokens=2,  # type: ignore[arg-type]
                                         extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert out.choices[0].message.role == "assistant"


def test_endpoints_this_server_does_not_have_are_a_clean_404(client: OpenAI, model_name: str) -> None:
    """What a client of the paid API may call and we do not serve: a 404 in the OpenAI error shape, which the
    SDK raises as NotFoundError (not a parse error on an HTML page)."""
    with pytest.raises(openai.NotFoundError) as exc:
        client.embeddings.create(model=model_name, input="hello")
    assert exc.value.status_code == 404 and isinstance(exc.value.body, dict) and exc.value.body.get("message")
    with pytest.raises(openai.NotFoundError):
        client.images.generate(prompt="a cat", model=model_name)


@pytest.mark.parametrize("key", ["\u00b2", "\u0661\u0662", "7" * 5000, "-1", "1.5", ""])
def test_logit_bias_keys_that_are_no_token_id_are_a_400(server: ServerThread, key: str) -> None:
    """Issue 24: "²" passed str.isdigit() and then failed int() with a 500; Arabic-Indic digits were taken."""
    r = _post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "logit_bias": {key: 1.0}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "logit_bias"
