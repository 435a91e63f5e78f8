"""The Messages API's clients on the built-in model, as applications use them (only base_url and a key changed):
the anthropic Python SDK (a tool round trip, streaming), LangChain's ChatAnthropic, pydantic-ai's AnthropicModel,
litellm's Anthropic provider (in .venv-clients), the JavaScript clients (tests/js: the anthropic and openai SDKs,
the Vercel AI SDK); and a 1,024-token cache_control system prompt: written, then read with a registered prefix's
time to first token."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import anthropic
import pytest

from tests.helpers.server import ServerThread, http

ROOT = Path(__file__).resolve().parents[3]
WEATHER = {"name": "get_weather", "description": "The current weather of a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}


def _client(server: ServerThread) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def test_anthropic_sdk_tool_round_trip_and_stream(real_server: ServerThread) -> None:
    c, model = _client(real_server), real_server.state.model_name
    convo: list[Any] = [{"role": "user", "content": "What is the weather in Paris?"}]
    call = c.messages.create(model=model, max_tokens=32, tools=[WEATHER], tool_choice={"type": "any"},  # type: ignore[list-item]
                             messages=convo, extra_body={"temperature": 0.0})
    uses = [b for b in call.content if b.type == "tool_use"]
    assert call.stop_reason == "tool_use" and uses and uses[0].name == "get_weather"
    assert isinstance(uses[0].input, dict) and "city" in uses[0].input
    convo += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in call.content]},
              {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id,
                                            "content": "18 C and sunny"}]}]
    final = c.messages.create(model=model, max_tokens=16, tools=[WEATHER], messages=convo,  # type: ignore[list-item]
                              extra_body={"temperature": 0.0})
    assert final.content and final.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # a forced call streams its input as input_json_delta events
    with c.messages.stream(model=model, max_tokens=24, tools=[WEATHER],                     # type: ignore[list-item]
                           tool_choice={"type": "tool", "name": "get_weather"},
                           messages=[{"role": "user", "content": "Weather in Rome?"}],
                           extra_body={"temperature": 0.0}) as s:
        kinds = [e.type for e in s]
        msg = s.get_final_message()
    assert "input_json" in kinds and msg.stop_reason == "tool_use"
    assert msg.content[0].type == "tool_use" and "city" in msg.content[0].input           # type: ignore[union-attr]
    # a call cut by max_tokens is reported as such, not as a tool_use to run (at temperature 1 the call above once
    # ran past its 24 tokens and came back as tool_use with input {})
    with c.messages.stream(model=model, max_tokens=5, tools=[WEATHER],                     # type: ignore[list-item]
                           tool_choice={"type": "tool", "name": "get_weather"},
                           messages=[{"role": "user", "content": "Weather in Rome?"}],
                           extra_body={"temperature": 0.0}) as s:
        cut = s.get_final_message()
    assert cut.stop_reason == "max_tokens", cut                  # was tool_use, with input {}
    c.close()


def test_a_cached_system_prompt_of_1024_tokens(real_server: ServerThread) -> None:
    """The first request reports it in cache_creation_input_tokens, the second in cache_read_input_tokens, with a
    time to first token like a registered prefix's (medians of 3 here: the same blocks either way)."""
    c, model = _client(real_server), real_server.state.model_name
    words = " ".join(f"clause {i}: refunds within {i % 30 + 1} days." for i in range(150))
    text = f"Contract {uuid.uuid4().hex[:6]}. {words}"
    n = c.messages.count_tokens(model=model, system=text, messages=[{"role": "user", "content": "x"}]).input_tokens
    text = text[:int(len(text) * 1024 / n)]                       # about 1,024 tokens of system prompt
    system: Any = [{"type": "text", "text": text, "cache_control": {"type": "ephemeral"}}]

    def ask(q: str) -> tuple[Any, float]:
        t0 = time.perf_counter()
        with c.messages.stream(model=model, max_tokens=2, system=system, messages=[{"role": "user", "content": q}],
                               extra_body={"temperature": 0.0}) as s:
            first = None
            for e in s:
                if e.type == "content_block_delta" and first is None:
                    first = time.perf_counter() - t0
            return s.get_final_message().usage, first or time.perf_counter() - t0
    first, cold = ask("Is a refund possible?")
    assert first.cache_read_input_tokens < 64 and first.cache_creation_input_tokens >= 1024 - 64
    second, _ = ask("Can I return it?")
    assert second.cache_creation_input_tokens == 0
    assert second.cache_read_input_tokens >= first.cache_creation_input_tokens
    warm = sorted(ask(f"Question {i}?")[1] for i in range(3))[1]
    # the same prompt through a registered prefix
    status, _ = http("POST", f"{real_server.url}/v1/prefixes", {"name": "contract", "messages": [
        {"role": "system", "content": text}]})
    assert status == 201
    named = []
    for i in range(3):
        t0 = time.perf_counter()
        status, out = http("POST", f"{real_server.url}/v1/chat/completions", {
            "prefix": "contract", "max_tokens": 1, "messages": [{"role": "user", "content": f"Point {i}?"}]})
        named.append(time.perf_counter() - t0)
        assert status == 200 and out["usage"]["prompt_tokens_details"]["cached_tokens"] >= 1024 - 64
    assert http("DELETE", f"{real_server.url}/v1/prefixes/contract")[0] == 200
    assert warm < cold / 2, (warm, cold)                       # a read, not a recompute of 1,024 tokens
    assert warm < sorted(named)[1] * 2 + 0.05, (warm, named)   # like a registered prefix's
    c.close()


def test_langchain_chat_anthropic(real_server: ServerThread) -> None:
    lc = pytest.importorskip("langchain_anthropic")
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool

    llm = lc.ChatAnthropic(base_url=real_server.url, api_key="unused", model=real_server.state.model_name,
                           temperature=0.0, max_tokens=32, max_retries=0)
    first = llm.invoke("What is the capital of France?")
    assert "Paris" in first.content
    chunks = list(llm.stream("What is the capital of France?"))
    assert len(chunks) >= 3 and "".join(str(c.content) for c in chunks) == first.content

    @tool
    def get_weather(city: str) -> str:
        """The current weather of a city."""
        return "18 C and sunny"

    messages: list[Any] = [HumanMessage("What is the weather in Paris?")]
    ai = llm.bind_tools([get_weather], tool_choice="any").invoke(messages)
    assert ai.tool_calls and ai.tool_calls[0]["name"] == "get_weather"
    messages.append(ai)
    for call in ai.tool_calls:
        messages.append(ToolMessage(get_weather.invoke(call["args"]), tool_call_id=call["id"]))
    final = llm.bind_tools([get_weather]).invoke(messages)
    assert final.content or final.tool_calls
    cached = lc.ChatAnthropic(base_url=real_server.url, api_key="unused", model=real_server.state.model_name,
                              max_tokens=2, max_retries=0)
    system = {"type": "text", "text": f"Desk {uuid.uuid4().hex[:6]}. " + "Answer briefly and politely. " * 12,
              "cache_control": {"type": "ephemeral"}}
    from langchain_core.messages import SystemMessage
    usage = [cached.invoke([SystemMessage([system]), HumanMessage("Hi")]).usage_metadata for _ in range(2)]
    written = usage[0]["input_token_details"]["ephemeral_5m_input_tokens"]            # type: ignore[index]
    assert written > 0 and usage[1]["input_token_details"]["cache_read"] >= written   # type: ignore[index]


def test_pydantic_ai_anthropic_model(real_server: ServerThread) -> None:
    """A plain run, and a structured output (pydantic-ai's forced `final_result` tool) validated by its model."""
    pytest.importorskip("pydantic_ai")
    from pydantic import BaseModel
    from pydantic_ai import Agent
    from pydantic_ai.models.anthropic import AnthropicModel
    from pydantic_ai.providers.anthropic import AnthropicProvider

    class City(BaseModel):
        name: str
        country: str

    async def run() -> tuple[str, City]:
        provider = AnthropicProvider(anthropic_client=anthropic.AsyncAnthropic(
            base_url=real_server.url, api_key="unused", max_retries=0))
        model = AnthropicModel(real_server.state.model_name, provider=provider)
        settings: Any = {"max_tokens": 32, "temperature": 0.0}
        plain = await Agent(model, model_settings=settings).run("What is the capital of France?")
        city = await Agent(model, output_type=City, model_settings={**settings, "max_tokens": 64}).run(
            "Which city is the capital of France?")
        return plain.output, city.output
    plain, city = asyncio.run(run())
    assert "Paris" in plain and isinstance(city, City) and city.name


CLIENTS_PYTHON = ROOT / ".venv-clients" / "bin" / "python"


def test_litellm_anthropic_provider(real_server: ServerThread) -> None:
    if not CLIENTS_PYTHON.is_file():
        pytest.skip("no .venv-clients (make test makes it)")
    script = ROOT / "tests" / "helpers" / "litellm_anthropic_client.py"
    out = subprocess.run([str(CLIENTS_PYTHON), str(script), real_server.url, real_server.state.model_name],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "LITELLM_LOCAL_MODEL_COST_MAP": "True"})
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert "Paris" in got["text"] and got["streamed"].strip()
    assert got["tool"] == "get_weather" and got["cache_write"] > 0 and got["cache_read"] >= got["cache_write"]


JS = ROOT / "tests" / "js"


def test_javascript_clients(real_server: ServerThread) -> None:
    """tests/js/clients.mjs (`make test` installs its node project): the anthropic JS SDK (create, stream,
    count_tokens, cache_control with both TTLs, a tool round trip), the openai JS SDK, and the Vercel AI SDK's
    generateObject with the openai and anthropic providers' defaults, and streamText."""
    if shutil.which("node") is None or not (JS / "node_modules").is_dir():
        pytest.skip("no node, or tests/js not installed (make test installs it)")
    out = subprocess.run(["node", "clients.mjs", real_server.url, real_server.state.model_name], cwd=JS,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert "Paris" in got["anthropic_text"] and got["anthropic_streamed"] == got["anthropic_text"]
    assert got["anthropic_events"] == ["message_start", "content_block_start", "content_block_delta",
                                       "content_block_stop", "message_delta", "message_stop"]
    assert got["anthropic_count"] > 0
    first, second = got["cache"]
    assert first["cache_creation"]["ephemeral_1h_input_tokens"] > 0
    assert first["cache_creation"]["ephemeral_5m_input_tokens"] > 0
    assert second["cache_read_input_tokens"] >= first["cache_creation_input_tokens"] > 0
    assert got["tool"]["stop_reason"] == "tool_use" and got["tool"]["name"] == "get_weather"
    assert got["tool_after"]
    assert "Paris" in got["openai_text"] and got["openai_cached"] >= 0
    for name, obj in got["objects"].items():
        assert set(obj) == {"name", "country"} and all(isinstance(v, str) for v in obj.values()), name
    assert got["objects"]["openai"] == {"name": "Paris", "country": "France"}
    assert set(got["objects"]) == {"openai", "anthropic"}
    assert got["vercel_streamed"].strip()
