"""POST /v1/chat/completions: messages through the model's chat template, streaming or not."""
from __future__ import annotations

from typing import Any

from aiohttp import web

from service.generation import ChoiceDelta, Generation
from service.logprobs import chat_logprobs
from service.protocol import read_body
from service.respond import prepare, respond
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

    def chunks(gen: Generation, d: ChoiceDelta) -> list[dict[str, Any]]:
        delta: dict[str, Any] = {"content": d.text} if d.text or d.finish_reason is None else {}
        if d.index not in started:
            started.add(d.index)
            delta = {"role": "assistant", "content": d.text}
        chunk: dict[str, Any] = {**head(gen), "choices": [
            {"index": d.index, "delta": delta, "logprobs": logprobs(d), "finish_reason": d.finish_reason}]}
        if req.return_token_ids:
            chunk["choices"][0]["token_ids"] = d.token_ids
        if req.include_usage:
            chunk["usage"] = None
        return [chunk]

    def body_of(gen: Generation, choices: list[ChoiceDelta]) -> dict[str, Any]:
        out = {**head(gen), "object": "chat.completion", "choices": [
            {"index": c.index, "message": {"role": "assistant", "content": c.text}, "logprobs": logprobs(c),
             "finish_reason": c.finish_reason, **({"token_ids": c.token_ids} if req.return_token_ids else {})}
            for c in choices]}
        if req.return_token_ids:
            out["prompt_token_ids"] = gen.prompts[0]
        return out

    return await respond(request, [prompt], req, head=head, chunks=chunks, body=body_of)
