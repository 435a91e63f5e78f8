"""The Responses API: POST /v1/responses, GET and DELETE /v1/responses/{id} (OpenAI's shapes, what
`client.responses.create` and the Agents SDK's default model speak).

A Responses request becomes a chat request and takes the one request pipeline (service/openai/pipeline.py):
the same template, tools, structured output, named prefix (`prefix`, ours), limits and engine. This module
only translates in and shapes out:

    in    `instructions` -> a system message (this request's only, as OpenAI: not carried by
          previous_response_id); `input` (text, or items: messages with input_text / output_text parts,
          function_call and function_call_output items; reasoning items dropped) -> messages;
          `previous_response_id` -> that response's conversation (its input and its output) first;
          tools {type: function, name, ...} and tool_choice -> chat's; `text.format` -> response_format;
          max_output_tokens -> max_tokens
    out   output items: one `message` (output_text) for the text, one `function_call` per tool call; status
          "incomplete" (max_output_tokens) when the answer was cut; usage as input / output tokens with
          cached_tokens. Streaming sends the SDK's events (response.created, .output_item.added,
          .output_text.delta, ..., response.completed), each with its sequence_number.

Stored responses (`store`, default true) live in a bounded in-memory store (RESPONSE_STORE_MAX responses,
RESPONSE_STORE_BYTES of conversation text; the least recently used go first), per replica and lost on
restart, and each is readable only with the key that created it (another key gets 404, as a missing one).
"""
from __future__ import annotations

import hashlib
import json
import logging
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from engine.errors import EngineError
from service.errors import ApiError, invalid, to_api_error
from service.middleware.access_log import record_usage
from service.middleware.auth import presented_key
from service.middleware.metrics import METRICS
from service.openai import pipeline, prompt_cache
from service.openai.generation import ChoiceDelta, Generation
from service.openai.params import check_model
from service.openai.pipeline import Prepared, read_body
from service.openai.schema import ResponsesRequest, parse_model
from service.openai.sse import KEEPALIVE, SSE_HEADERS, SSEResponse
from service.state import STATE
from service.tenants import caller_of

RESPONSE_STORE_MAX = 1024                 # stored responses per replica
RESPONSE_STORE_BYTES = 64 * 2**20         # and their conversations' text, in all


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


# -- the store -----------------------------------------------------------------------------------------------
@dataclass
class Stored:
    owner: str                          # the creating key's digest ("" without keys)
    response: dict[str, Any]            # as returned
    conversation: list[dict[str, Any]]  # chat messages: its input (after previous ones), then its output
    size: int


class ResponseStore:
    """Bounded, least recently used first out; owned by the event loop."""

    def __init__(self, max_items: int = RESPONSE_STORE_MAX, max_bytes: int = RESPONSE_STORE_BYTES) -> None:
        self.max_items, self.max_bytes = max_items, max_bytes
        self._items: OrderedDict[str, Stored] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._items)

    def get(self, rid: str, owner: str) -> Stored | None:
        item = self._items.get(rid)
        if item is None or item.owner != owner:
            return None
        self._items.move_to_end(rid)
        return item

    def put(self, rid: str, item: Stored) -> None:
        if item.size > self.max_bytes:
            return                      # larger than the whole store: not kept (GET says 404)
        self._items[rid] = item
        self.bytes += item.size
        while len(self._items) > self.max_items or self.bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self.bytes -= old.size

    def delete(self, rid: str, owner: str) -> bool:
        item = self._items.get(rid)
        if item is None or item.owner != owner:
            return False
        del self._items[rid]
        self.bytes -= item.size
        return True


STORE = web.AppKey("response_store", ResponseStore)


def setup(app: web.Application) -> None:
    app[STORE] = ResponseStore()
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", get_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)


def _owner(request: web.Request) -> str:
    key = presented_key(request)
    return hashlib.sha256(key.encode()).hexdigest() if key else ""


def _not_found(rid: str, param: str | None = None) -> ApiError:
    return ApiError(404, f"No response with id {rid!r} found.", type="invalid_request_error", param=param,
                    code="response_not_found")


# -- out: items and events ---------------------------------------------------------------------------------
@dataclass
class _Answer:
    text: str | None
    calls: list[dict[str, Any]]          # chat tool calls (id, function: name, arguments)
    finish: str | None


def _answer(prepared: Prepared, c: ChoiceDelta) -> _Answer:
    plan = prepared.req.tools
    if plan is None:
        return _Answer(c.text, [], c.finish_reason)
    content, calls = plan.calls(c.text)
    return _Answer(content, [t.as_dict() for t in calls], c.finish_reason)


def _message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(call: dict[str, Any]) -> dict[str, Any]:
    return {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call["id"],
            "name": call["function"]["name"], "arguments": call["function"]["arguments"], "status": "completed"}


def _items(answer: _Answer) -> list[dict[str, Any]]:
    out = [_message_item(answer.text or "")] if answer.text or not answer.calls else []
    return out + [_call_item(c) for c in answer.calls]


def _usage(gen: Generation) -> dict[str, Any]:
    u = gen.usage
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens,
                                                                      "cache_write_tokens": u.cache_write_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}


def _response(rid: str, created: float, model: str, body: ResponsesRequest, status: str,
              output: list[dict[str, Any]], usage: dict[str, Any] | None) -> dict[str, Any]:
    choice = body.tool_choice
    return {
        "id": rid, "object": "response", "created_at": created, "model": model, "status": status,
        "output": output, "usage": usage, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": body.instructions, "previous_response_id": body.previous_response_id,
        "tools": [t.model_dump(exclude_none=True) for t in body.tools or []],
        "tool_choice": choice if isinstance(choice, str) else (choice.model_dump() if choice else "auto"),
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "temperature": body.temperature, "top_p": body.top_p, "max_output_tokens": body.max_output_tokens,
        "store": body.store is not False, "metadata": body.metadata or {},
        "text": {"format": (body.text.format.model_dump(by_alias=True, exclude_none=True)
                            if body.text is not None and body.text.format is not None else {"type": "text"})},
        "truncation": body.truncation or "disabled", "background": False, "reasoning": None,
        "output_text": None,
    }


class _Events:
    """SSE writer of Responses events (`event: <type>` + `data: {...}` with a sequence number)."""

    def __init__(self, resp: web.StreamResponse) -> None:
        self.resp, self.seq = resp, 0

    def frame(self, kind: str, **payload: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **payload}
        self.seq += 1
        return f"event: {kind}\ndata: ".encode() + json.dumps(data, ensure_ascii=False,
                                                             separators=(",", ":")).encode() + b"\n\n"

    async def send(self, kind: str, **payload: Any) -> None:
        await self.resp.write(self.frame(kind, **payload))


log = logging.getLogger(__name__)
_PARAMS = {"max_tokens": "max_output_tokens", "response_format": "text", "messages": "input"}   # chat's -> ours


# -- handlers --------------------------------------------------------------------------------------------------
async def create_response(request: web.Request) -> web.StreamResponse:
    ready = request.app[STATE].ready()
    store, owner = request.app[STORE], _owner(request)
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
            prepared = await pipeline.prepare(ready, chat, chat=True, caller=caller_of(request), size=len(raw))
        except ApiError as exc:          # named as this API names the field
            exc.param = _PARAMS.get(exc.param or "", exc.param)
            raise
    gen = await pipeline.submit(prepared, request.app[METRICS])
    headers = pipeline.ignored_fields(ignored)
    rid, created = f"resp_{gen.id}", float(int(time.time()))
    def keep(out: dict[str, Any]) -> None:      # the prompt-cache options' part first (service/openai/prompt_cache.py)
        prompt_cache.finish(request, prepared, gen, body, rid, history + new, out)
        _keep(store, owner, rid, out, history + new, body)
    try:
        if body.stream:
            return await _stream(request, gen, prepared, body, rid, created, headers, keep)
        choices = await gen.collect()
        await pipeline.leased(prepared)
        answer = _answer(prepared, choices[0])
        status = "incomplete" if answer.finish == "length" else "completed"
        out = _response(rid, created, ready.model_name, body, status, _items(answer), _usage(gen))
        keep(out)
        return web.json_response(out, headers=headers)
    finally:
        gen.close()
        record_usage(request, gen.usage)


def _keep(store: ResponseStore, owner: str, rid: str, out: dict[str, Any], conversation: list[dict[str, Any]],
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
    store.put(rid, Stored(owner, out, full, size))


async def _stream(request: web.Request, gen: Generation, prepared: Prepared, body: ResponsesRequest, rid: str,
                  created: float, headers: dict[str, str], keep: Any) -> web.StreamResponse:
    """The SDK's event sequence. Plain text streams as it comes; with tools the answer is held to the end
    (it may turn out to be a call) and its items are then sent whole."""
    model = prepared.ready.model_name
    resp = SSEResponse(request, prepared.ready.config.write_timeout, {**SSE_HEADERS, **headers})
    await resp.prepare(request)
    ev = _Events(resp)
    shell = _response(rid, created, model, body, "in_progress", [], None)
    await ev.send("response.created", response=shell)
    await ev.send("response.in_progress", response=shell)
    live = prepared.req.tools is None
    msg_id, text, finish, opened = f"msg_{uuid.uuid4().hex}", "", None, False
    try:
        async for d in gen.events(prepared.ready.config.keepalive_interval):
            if d is None:
                await resp.write(KEEPALIVE)
                continue
            if d.index != 0:
                continue
            text += d.text
            finish = d.finish_reason or finish
            if live and d.text:
                if not opened:
                    opened = True
                    await _open_message(ev, msg_id)
                await ev.send("response.output_text.delta", item_id=msg_id, output_index=0, content_index=0,
                              delta=d.text, logprobs=[])
    except EngineError as exc:
        err = to_api_error(exc).body()["error"]
        await ev.send("error", code=err.get("code"), message=err["message"], param=err.get("param"))
        await resp.write_eof()
        return resp
    except ConnectionError:
        return resp
    except Exception:           # a fault of ours after the headers: the stream still ends, with an error event
        log.exception("a streamed response failed after its headers were sent")
        await ev.send("error", code="internal_error", message="internal error while streaming the response",
                      param=None)
        await resp.write_eof()
        return resp
    answer = _answer(prepared, ChoiceDelta(0, text, [], finish))
    try:               # the answer's items, whole: a client gone or not reading by now just misses them
        items: list[dict[str, Any]] = []
        if live:
            if not opened:
                await _open_message(ev, msg_id)
            items.append(await _close_message(ev, msg_id, 0, text))
        else:
            for item in _items(answer):
                index = len(items)
                if item["type"] == "message":
                    await _open_message(ev, item["id"], index)
                    if item["content"][0]["text"]:
                        await ev.send("response.output_text.delta", item_id=item["id"], output_index=index,
                                      content_index=0, delta=item["content"][0]["text"], logprobs=[])
                    items.append(await _close_message(ev, item["id"], index, item["content"][0]["text"]))
                else:
                    await ev.send("response.output_item.added", output_index=index,
                                  item={**item, "arguments": "", "status": "in_progress"})
                    await ev.send("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                                  delta=item["arguments"])
                    await ev.send("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                                  name=item["name"], arguments=item["arguments"])
                    await ev.send("response.output_item.done", output_index=index, item=item)
                    items.append(item)
        status = "incomplete" if answer.finish == "length" else "completed"
        await pipeline.leased(prepared)
        final = _response(rid, created, model, body, status, items, _usage(gen))
        keep(final)
        status = final["status"]
        await ev.send("response.incomplete" if status == "incomplete" else "response.completed", response=final)
        await resp.write_eof()
    except ConnectionError:
        pass
    return resp


async def _open_message(ev: _Events, item_id: str, index: int = 0) -> None:
    item = _message_item("", "in_progress", item_id)
    item["content"] = []
    await ev.send("response.output_item.added", output_index=index, item=item)
    await ev.send("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                  part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})


async def _close_message(ev: _Events, item_id: str, index: int, text: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    await ev.send("response.output_text.done", item_id=item_id, output_index=index, content_index=0, text=text,
                  logprobs=[])
    await ev.send("response.content_part.done", item_id=item_id, output_index=index, content_index=0, part=part)
    item = _message_item(text, "completed", item_id)
    await ev.send("response.output_item.done", output_index=index, item=item)
    return item


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
