"""POST /v1/chat/completions: messages through the model's chat template, streaming or not."""
from __future__ import annotations

from typing import Any

from aiohttp import web

from service.openai.generation import ChoiceDelta, Generation
from service.openai.logprobs import chat_logprobs
from service.openai.params import read_body
from service.openai.respond import prepare, respond
from service.openai.tools import ToolCallStream
from service.state import STATE


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    state.ready_engine()                      # 503 before reading a body while warming
    raw = await read_body(request, state.config.body_timeout)
    model = state.model_name
    prepared, (prompt,) = await prepare(request.app, raw, chat=True)
    req = prepared.req
    started: set[int] = set()      # choices whose first chunk (with the role) went out
    top_k = req.params.logprobs
    tokens = state.token_text() if top_k is not None else None

    def logprobs(d: ChoiceDelta) -> dict[str, Any] | None:
        if tokens is None or top_k is None:
            return None
        return chat_logprobs(tokens, d.token_ids, d.logprobs or [], top_k)

    def head(gen: Generation) -> dict[str, Any]:
        return {"id": f"chatcmpl-{gen.id}", "object": "chat.completion.chunk", "created": gen.created,
                "model": model}

    plan = req.tools
    calling: dict[int, ToolCallStream] = {}     # choice -> its tool-call state (requests with tools)

    def chunks(gen: Generation, d: ChoiceDelta) -> list[dict[str, Any]]:
        if plan is None:
            deltas: list[dict[str, Any]] = [{"content": d.text}] if d.text or d.finish_reason is None else [{}]
        else:
            stream = calling.setdefault(d.index, ToolCallStream(plan))
            deltas = stream.feed(d.text, d.finish_reason is not None) or [{}]
        finish = d.finish_reason
        if plan is not None and finish == "stop" and calling[d.index].has_calls:
            finish = "tool_calls"
        out = []
        for i, delta in enumerate(deltas):
            if d.index not in started:
                started.add(d.index)
                delta = {"role": "assistant", "content": None if "tool_calls" in delta else "", **delta}
            last = i == len(deltas) - 1
            if not delta and not last:
                continue
            chunk: dict[str, Any] = {**head(gen), "choices": [
                {"index": d.index, "delta": delta, "logprobs": logprobs(d) if last else None,
                 "finish_reason": finish if last else None}]}
            if req.return_token_ids:
                chunk["choices"][0]["token_ids"] = d.token_ids if last else []
            if req.include_usage:
                chunk["usage"] = None
            out.append(chunk)
        return out

    def message(c: ChoiceDelta) -> tuple[dict[str, Any], str | None]:
        if plan is None:
            return {"role": "assistant", "content": c.text}, c.finish_reason
        content, calls = plan.calls(c.text)
        if not calls:
            return {"role": "assistant", "content": content}, c.finish_reason
        finish = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
        return {"role": "assistant", "content": content, "tool_calls": [t.as_dict() for t in calls]}, finish

    def body_of(gen: Generation, choices: list[ChoiceDelta]) -> dict[str, Any]:
        items = []
        for c in choices:
            msg, finish = message(c)
            items.append({"index": c.index, "message": msg, "logprobs": logprobs(c), "finish_reason": finish,
                          **({"token_ids": c.token_ids} if req.return_token_ids else {})})
        out = {**head(gen), "object": "chat.completion", "choices": items}
        if req.return_token_ids:
            out["prompt_token_ids"] = gen.prompts[0]
        return out

    return await respond(request, [prompt], req, head=head, chunks=chunks, body=body_of)
