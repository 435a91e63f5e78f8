"""POST /v1/chat/completions: messages through the model's chat template, streaming or not.

This module is only the chat shape of an answer (roles, tool calls, chat logprobs); every other step is
the request pipeline's (service/openai/pipeline.py)."""
from __future__ import annotations

from typing import Any

from aiohttp import web

from service.openai import pipeline
from service.openai.generation import ChoiceDelta, Generation
from service.openai.logprobs import chat_logprobs
from service.openai.pipeline import ChunkShaper, Prepared
from service.openai.tools import ToolCallStream


async def create_chat_completion(request: web.Request) -> web.StreamResponse:
    return await pipeline.serve(request, chat=True, shaper=ChatShaper)


class ChatShaper(ChunkShaper):
    def __init__(self, prepared: Prepared) -> None:
        self.req = prepared.req
        self.model = prepared.ready.model_name
        self.top_k = self.req.params.logprobs
        self.tokens = prepared.ready.token_text if self.top_k is not None else None
        self.plan = self.req.tools
        self.started: set[int] = set()                  # choices whose first chunk (with the role) went out
        self.calling: dict[int, ToolCallStream] = {}    # choice -> its tool-call state (requests with tools)

    def _logprobs(self, d: ChoiceDelta) -> dict[str, Any] | None:
        if self.tokens is None or self.top_k is None:
            return None
        return chat_logprobs(self.tokens, d.token_ids, d.logprobs or [], self.top_k)

    def head(self, gen: Generation) -> dict[str, Any]:
        return {"id": f"chatcmpl-{gen.id}", "object": "chat.completion.chunk", "created": gen.created,
                "model": self.model}

    def chunks(self, gen: Generation, d: ChoiceDelta) -> list[dict[str, Any]]:
        plan, req = self.plan, self.req
        if plan is None:
            deltas: list[dict[str, Any]] = [{"content": d.text}] if d.text or d.finish_reason is None else [{}]
        else:
            stream = self.calling.setdefault(d.index, ToolCallStream(plan))
            deltas = stream.feed(d.text, d.finish_reason is not None) or [{}]
        finish = d.finish_reason
        if plan is not None and finish == "stop" and self.calling[d.index].has_calls:
            finish = "tool_calls"
        out = []
        for i, delta in enumerate(deltas):
            if d.index not in self.started:
                self.started.add(d.index)
                delta = {"role": "assistant", "content": None if "tool_calls" in delta else "", **delta}
            last = i == len(deltas) - 1
            if not delta and not last:
                continue
            chunk: dict[str, Any] = {**self.head(gen), "choices": [
                {"index": d.index, "delta": delta, "logprobs": self._logprobs(d) if last else None,
                 "finish_reason": finish if last else None}]}
            if req.return_token_ids:
                chunk["choices"][0]["token_ids"] = d.token_ids if last else []
            if req.include_usage:
                chunk["usage"] = None
            out.append(chunk)
        return out

    def _message(self, c: ChoiceDelta) -> tuple[dict[str, Any], str | None]:
        plan = self.plan
        if plan is None:
            return {"role": "assistant", "content": c.text}, c.finish_reason
        content, calls = plan.calls(c.text)
        if not calls:
            return {"role": "assistant", "content": content}, c.finish_reason
        finish = "tool_calls" if c.finish_reason == "stop" else c.finish_reason
        return {"role": "assistant", "content": content, "tool_calls": [t.as_dict() for t in calls]}, finish

    def body(self, gen: Generation, choices: list[ChoiceDelta]) -> dict[str, Any]:
        items = []
        for c in choices:
            msg, finish = self._message(c)
            items.append({"index": c.index, "message": msg, "logprobs": self._logprobs(c), "finish_reason": finish,
                          **({"token_ids": c.token_ids} if self.req.return_token_ids else {})})
        out = {**self.head(gen), "object": "chat.completion", "choices": items}
        if self.req.return_token_ids:
            out["prompt_token_ids"] = gen.shown_prompt(0)
        return {**out, "usage": gen.usage.as_dict()}
