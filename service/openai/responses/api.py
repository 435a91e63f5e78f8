"""The Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id} (OpenAI's shapes, what
`client.responses.create` and the Agents SDK's default model speak).

A Responses request becomes a chat request and takes the one request pipeline (service/openai/pipeline.py):
the same template, tools, structured output, named prefix (`prefix`, ours), prompt_cache_key lease, limits,
engine and answer stage (a whole answer waits for its lease; a stream is written by sse.stream, with its
guard on every write after the headers). This module only translates in; shaper.py shapes out:

    in    `instructions` -> a system message (this request's only, as OpenAI: not carried by
          previous_response_id); `input` (text, or items: messages with input_text / output_text parts,
          function_call and function_call_output items; reasoning items dropped) -> messages;
          `previous_response_id` -> that response's conversation (its input and its output) first;
          tools {type: function, name, ...} and tool_choice -> chat's; `text.format` -> response_format;
          max_output_tokens -> max_tokens

Stored responses (`store`, default true) live in service/openai/responses/store.py: bounded, shared fairly
between tenants, each readable only with the key that created it (another key gets 404, as a missing one).
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

from aiohttp import web

from service.errors import ApiError, invalid
from service.middleware.auth import presented_key
from service.openai import pipeline
from service.openai.generation import Generation
from service.openai.params import check_model
from service.openai.pipeline import read_body
from service.openai.responses import prompt_cache
from service.openai.responses.shaper import ResponsesShaper
from service.openai.responses.store import STORE, ResponseStore, Stored
from service.openai.schema import ResponsesRequest, parse_model
from service.state import STATE
from service.tenants import caller_of

# -- input -> chat messages -----------------------------------------------------------------------------
_TEXT_PARTS = ("input_text", "output_text", "text")


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{where}: content must be a string or a list of text parts", "input")
    out = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise invalid(f"{where}: only text parts are supported here, got {kind!r}", "input")
        out.append(part["text"])
    return "".join(out)


def _str_field(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise invalid(f"{where}: {key} must be a non-empty string", "input")
    return value


def to_messages(items: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages of a Responses `input` (the module docstring's table)."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise invalid(f"{where}: role must be user, system, developer or assistant", "input")
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            call = {"id": _str_field(item, "call_id", where), "type": "function",
                    "function": {"name": _str_field(item, "name", where),
                                 "arguments": item.get("arguments") if isinstance(item.get("arguments"), str)
                                 else json.dumps(item.get("arguments") or {})}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":     # text then calls, or parallel calls: one turn
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _str_field(item, "call_id", where),
                             "content": output if isinstance(output, str) else _text(output, where)})
        elif kind == "reasoning":
            continue                                     # another model's reasoning: nothing to show this one
        else:
            raise invalid(f"{where}: input items of type {kind!r} are not supported (message, function_call, "
                          "function_call_output)", "input")
    return messages


def _chat_body(body: ResponsesRequest, history: list[dict[str, Any]]) -> dict[str, Any]:
    chat: dict[str, Any] = {"messages": ([{"role": "system", "content": body.instructions}] if body.instructions
                                         else []) + history}
    if body.tools:
        chat["tools"] = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})}
                         for t in body.tools]
    choice = body.tool_choice
    if choice is not None:
        chat["tool_choice"] = choice if isinstance(choice, str) else {"type": "function",
                                                                      "function": {"name": choice.name}}
    fmt = body.text.format if body.text is not None else None
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            chat["response_format"] = {"type": "json_object"}
        else:
            if fmt.name is None or fmt.schema_ is None:
                raise invalid("text.format json_schema needs a name and a schema", "text")
            chat["response_format"] = {"type": "json_schema", "json_schema": {
                "name": fmt.name, "schema": fmt.schema_, **({"strict": fmt.strict} if fmt.strict is not None else {})}}
    if body.stream:
        chat["stream"] = True
    for src, dst in (("parallel_tool_calls", "parallel_tool_calls"), ("temperature", "temperature"),
                     ("top_p", "top_p"), ("max_output_tokens", "max_tokens"), ("seed", "seed"), ("prefix", "prefix"),
                     ("prompt_cache_key", "prompt_cache_key"), ("prompt_cache_retention", "prompt_cache_retention"),
                     ("cache_salt", "cache_salt")):
        value = getattr(body, src)
        if value is not None:
            chat[dst] = value
    if body.prompt_cache_options is not None:
        chat["prompt_cache_options"] = prompt_cache.chat_options(body)
    return chat


# -- handlers --------------------------------------------------------------------------------------------------
_PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text", "messages": "input"}   # chat's -> ours


def setup(app: web.Application) -> None:
    config = app[STATE].config
    app[STORE] = ResponseStore(config.response_store_max, config.response_store_bytes)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)


def _owner(request: web.Request) -> str:
    key = presented_key(request)
    return hashlib.sha256(key.encode()).hexdigest() if key else ""


def _not_found(rid: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"No response with id {rid!r} found.", type="invalid_request_error", param=param,
                    code="response_not_found")


async def create_response(request: web.Request) -> web.StreamResponse:
    ready = request.app[STATE].ready()
    store, owner, caller = request.app[STORE], _owner(request), caller_of(request)
    with ready.engine.arriving():
        raw = await read_body(request, ready.config.body_timeout)
        ignored: list[str] = []
        body: ResponsesRequest = await ready.tokenizers.run(len(raw), ready.engine.tokenizer, lambda _: parse_model(
            ResponsesRequest, raw, ready.config.strict_fields, ignored))
        check_model(body.model, ready.model_name)
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            prev = store.get(body.previous_response_id, owner)
            if prev is None:
                raise _not_found(body.previous_response_id, "previous_response_id")
            history = [dict(m) for m in prev.conversation]
        new = await ready.tokenizers.run(len(raw), ready.engine.tokenizer, lambda _: to_messages(body.input))
        chat = _chat_body(body, history + new)
        try:
            prepared = await pipeline.prepare(ready, chat, chat=True, caller=caller, size=len(raw))
        except ApiError as exc:          # named as this API names the field
            exc.param = _PARAMS.get(exc.param or "", exc.param)
            raise
    tenant = caller.tenant or ""

    def keep(gen: Generation, out: dict[str, Any]) -> None:   # the prompt-cache options' part first (prompt_cache.py)
        prompt_cache.finish(request, prepared, gen, body, out["id"], history + new, out)
        _keep(store, owner, tenant, out, history + new, body)
    shaper = ResponsesShaper(prepared, body, keep)
    return await pipeline.answer(request, prepared, shaper, pipeline.ignored_fields(ignored))


def _keep(store: ResponseStore, owner: str, tenant: str, out: dict[str, Any], conversation: list[dict[str, Any]],
          body: ResponsesRequest) -> None:
    if body.store is False:
        return
    turn: list[dict[str, Any]] = []
    for item in out["output"]:
        if item["type"] == "message":
            turn.append({"role": "assistant", "content": "".join(p["text"] for p in item["content"])})
        elif item["type"] == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            if turn and turn[-1].get("tool_calls"):
                turn[-1]["tool_calls"].append(call)
            else:
                turn.append({"role": "assistant", "content": "", "tool_calls": [call]})
    full = conversation + turn
    size = len(json.dumps(full)) + len(json.dumps(out))
    store.put(out["id"], Stored(owner, tenant, out, full, size))


async def get_response(request: web.Request) -> web.Response:
    rid = request.match_info["response_id"]
    item = request.app[STORE].get(rid, _owner(request))
    if item is None:
        raise _not_found(rid)
    return web.json_response(item.response)


async def delete_response(request: web.Request) -> web.Response:
    rid = request.match_info["response_id"]
    if not request.app[STORE].delete(rid, _owner(request)):
        raise _not_found(rid)
    return web.json_response({"id": rid, "object": "response.deleted", "deleted": True})
