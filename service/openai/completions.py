"""POST /v1/completions (OpenAI legacy completions), streaming or not.

This module is only the completions shape of an answer; every other step is the request pipeline's
(service/openai/pipeline.py)."""
from __future__ import annotations

from typing import Any

from aiohttp import web

from service.openai import pipeline
from service.openai.generation import ChoiceDelta, Generation
from service.openai.logprobs import CompletionLogprobs
from service.openai.pipeline import ChunkShaper, Prepared


async def create_completion(request: web.Request) -> web.StreamResponse:
    return await pipeline.serve(request, chat=False, shaper=CompletionShaper)


class CompletionShaper(ChunkShaper):
    def __init__(self, prepared: Prepared) -> None:
        self.req = prepared.req
        self.model = prepared.ready.model_name
        self.logprobs = CompletionLogprobs(prepared.ready.token_text) if self.req.params.logprobs is not None \
            else None

    def head(self, gen: Generation) -> dict[str, Any]:
        return {"id": f"cmpl-{gen.id}", "object": "text_completion", "created": gen.created, "model": self.model}

    def chunks(self, gen: Generation, d: ChoiceDelta) -> list[dict[str, Any]]:
        chunk = {**self.head(gen), "choices": [self._choice(d)]}
        if self.req.include_usage:
            chunk["usage"] = None
        return [chunk]

    def body(self, gen: Generation, choices: list[ChoiceDelta]) -> dict[str, Any]:
        out = {**self.head(gen), "choices": [self._choice(c) for c in choices]}
        if self.req.return_token_ids:
            out["prompt_token_ids"] = [gen.shown_prompt(i) for i in range(len(gen.prompts))]
        return {**out, "usage": gen.usage.as_dict()}

    def _choice(self, d: ChoiceDelta) -> dict[str, Any]:
        lp = self.logprobs.format(d.index, d.token_ids, d.logprobs or []) if self.logprobs is not None else None
        c: dict[str, Any] = {"index": d.index, "text": d.text, "logprobs": lp, "finish_reason": d.finish_reason}
        if self.req.return_token_ids:
            c["token_ids"] = d.token_ids
        return c
