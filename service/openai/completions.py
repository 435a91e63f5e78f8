"""POST /v1/completions (OpenAI legacy completions), streaming or not."""
from __future__ import annotations

from typing import Any

from aiohttp import web

from service.openai.generation import ChoiceDelta, Generation
from service.openai.logprobs import CompletionLogprobs
from service.openai.params import GenerationRequest, read_body
from service.openai.respond import prepare, respond
from service.openai.schema import CompletionRequest
from service.state import STATE


async def create_completion(request: web.Request) -> web.StreamResponse:
    state = request.app[STATE]
    state.ready_engine()                      # 503 before reading a body while warming
    raw = await read_body(request, state.config.body_timeout)
    model = state.model_name
    prepared, prompts = await prepare(request.app, raw, chat=False)
    req = prepared.req
    logprobs = CompletionLogprobs(state.token_text()) if req.params.logprobs is not None else None

    def head(gen: Generation) -> dict[str, Any]:
        return {"id": f"cmpl-{gen.id}", "object": "text_completion", "created": gen.created, "model": model}

    def chunks(gen: Generation, d: ChoiceDelta) -> list[dict[str, Any]]:
        chunk = {**head(gen), "choices": [_choice(d, req, logprobs)]}
        if req.include_usage:
            chunk["usage"] = None
        return [chunk]

    def body_of(gen: Generation, choices: list[ChoiceDelta]) -> dict[str, Any]:
        out = {**head(gen), "choices": [_choice(c, req, logprobs) for c in choices]}
        if req.return_token_ids:
            out["prompt_token_ids"] = gen.prompts
        return out

    assert isinstance(prepared.body, CompletionRequest)
    prompt = prepared.body.prompt
    texts = [prompt] if isinstance(prompt, str) else [p for p in prompt if isinstance(p, str)] or None
    return await respond(request, prompts, req, head=head, chunks=chunks, body=body_of, texts=texts)


def _choice(d: ChoiceDelta, req: GenerationRequest, logprobs: CompletionLogprobs | None) -> dict[str, Any]:
    lp = logprobs.format(d.index, d.token_ids, d.logprobs or []) if logprobs is not None else None
    c: dict[str, Any] = {"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}
    if req.return_token_ids:
        c["token_ids"] = d.token_ids
    return c
