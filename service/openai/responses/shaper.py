"""The Responses API's shape of an answer: a Shaper of the request pipeline (service/openai/pipeline.py), as
chat's and completions' are, so a Responses answer takes the same `answer` stage and `sse.stream`.

    whole    the response object: one `message` item (output_text) for the text, one `function_call` item
             per tool call; status "incomplete" (max_output_tokens) when the answer was cut; usage as input /
             output tokens with cached_tokens and cache_write_tokens
    stream   the SDK's events (`event: <type>` + `data: {...}`, each with its sequence_number):
             response.created, .in_progress, then .output_item.added, .content_part.added,
             .output_text.delta ... for the text as it comes, then the closing .done events and
             response.completed (or .incomplete); with tools the answer is held to the end (it may turn out
             to be a call) and its items are then sent whole; a failure after the headers is an `error` event

Both hand the finished response to `keep` (the store, unless `store: false`).
"""
from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from service.errors import ApiError
from service.openai import pipeline, sse
from service.openai.generation import ChoiceDelta, Generation
from service.openai.schema import ResponsesRequest


@dataclass
class _Answer:
    text: str | None
    calls: list[dict[str, Any]]          # chat tool calls (id, function: name, arguments)
    finish: str | None


class ResponsesShaper:
    def __init__(self, prepared: pipeline.Prepared, body: ResponsesRequest,
                 keep: Callable[[Generation, dict[str, Any]], None]) -> None:
        self.prepared, self.request, self.keep = prepared, body, keep

    def response(self, gen: Generation, status: str, output: list[dict[str, Any]],
                 usage: dict[str, Any] | None) -> dict[str, Any]:
        body, choice = self.request, self.request.tool_choice
        return {
            "id": f"resp_{gen.id}", "object": "response", "created_at": float(gen.created),
            "model": self.prepared.ready.model_name, "status": status, "output": output, "usage": usage,
            "error": None, "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
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

    def answer(self, c: ChoiceDelta) -> _Answer:
        plan = self.prepared.req.tools
        if plan is None:
            return _Answer(c.text, [], c.finish_reason)
        content, calls = plan.calls(c.text)
        return _Answer(content, [t.as_dict() for t in calls], c.finish_reason)

    def finished(self, gen: Generation, answer: _Answer, output: list[dict[str, Any]]) -> dict[str, Any]:
        """The final response object, kept (the store) before it is sent."""
        out = self.response(gen, "incomplete" if answer.finish == "length" else "completed", output, usage(gen))
        self.keep(gen, out)
        return out

    def body(self, gen: Generation, choices: list[ChoiceDelta]) -> dict[str, Any]:
        answer = self.answer(choices[0])
        return self.finished(gen, answer, items(answer))

    def frames(self, gen: Generation) -> sse.Frames:
        return ResponseEvents(self, gen)


class ResponseEvents:
    """The streamed events (sse.Frames). Plain text streams as it comes; with tools the answer is held to the
    end and its items are then sent whole."""

    def __init__(self, shaper: ResponsesShaper, gen: Generation) -> None:
        self.shaper, self.gen, self.seq = shaper, gen, 0
        self.live = shaper.prepared.req.tools is None
        self.msg_id, self.text, self.opened = f"msg_{uuid.uuid4().hex}", "", False
        self.finish: str | None = None

    def event(self, kind: str, **payload: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **payload}
        self.seq += 1
        return f"event: {kind}\ndata: ".encode() + json.dumps(data, ensure_ascii=False,
                                                             separators=(",", ":")).encode() + b"\n\n"

    def opening(self) -> bytes:
        shell = self.shaper.response(self.gen, "in_progress", [], None)
        return self.event("response.created", response=shell) + self.event("response.in_progress", response=shell)

    def keepalive(self) -> bytes:
        return sse.KEEPALIVE

    def delta(self, d: ChoiceDelta) -> bytes:
        if d.index != 0:
            return b""
        self.text += d.text
        self.finish = d.finish_reason or self.finish
        if not (self.live and d.text):
            return b""
        out = b"" if self.opened else self._open_message(self.msg_id)
        self.opened = True
        return out + self.event("response.output_text.delta", item_id=self.msg_id, output_index=0, content_index=0,
                                delta=d.text, logprobs=[])

    async def closing(self) -> bytes:
        await pipeline.leased(self.shaper.prepared)     # a pre-warm's count of written tokens is final then
        answer = self.shaper.answer(ChoiceDelta(0, self.text, [], self.finish))
        out, output = b"", []
        if self.live:
            out += b"" if self.opened else self._open_message(self.msg_id)
            frames, item = self._close_message(self.msg_id, 0, self.text)
            out += frames
            output.append(item)
        else:
            for item in items(answer):
                index = len(output)
                if item["type"] == "message":
                    text = item["content"][0]["text"]
                    out += self._open_message(item["id"], index)
                    if text:
                        out += self.event("response.output_text.delta", item_id=item["id"], output_index=index,
                                          content_index=0, delta=text, logprobs=[])
                    frames, item = self._close_message(item["id"], index, text)
                    out += frames
                else:
                    out += (self.event("response.output_item.added", output_index=index,
                                       item={**item, "arguments": "", "status": "in_progress"})
                            + self.event("response.function_call_arguments.delta", item_id=item["id"],
                                         output_index=index, delta=item["arguments"])
                            + self.event("response.function_call_arguments.done", item_id=item["id"],
                                         output_index=index, name=item["name"], arguments=item["arguments"])
                            + self.event("response.output_item.done", output_index=index, item=item))
                output.append(item)
        final = self.shaper.finished(self.gen, answer, output)
        return out + self.event(f"response.{final['status']}", response=final)

    def failed(self, error: ApiError) -> bytes:
        err = error.body()["error"]
        return self.event("error", code=err.get("code"), message=err["message"], param=err.get("param"))

    def _open_message(self, item_id: str, index: int = 0) -> bytes:
        item = {**message_item("", "in_progress", item_id), "content": []}
        return (self.event("response.output_item.added", output_index=index, item=item)
                + self.event("response.content_part.added", item_id=item_id, output_index=index, content_index=0,
                             part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))

    def _close_message(self, item_id: str, index: int, text: str) -> tuple[bytes, dict[str, Any]]:
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        item = message_item(text, "completed", item_id)
        return (self.event("response.output_text.done", item_id=item_id, output_index=index, content_index=0,
                           text=text, logprobs=[])
                + self.event("response.content_part.done", item_id=item_id, output_index=index, content_index=0,
                             part=part)
                + self.event("response.output_item.done", output_index=index, item=item)), item


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {"type": "message", "id": item_id or f"msg_{uuid.uuid4().hex}", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def items(answer: _Answer) -> list[dict[str, Any]]:
    out = [message_item(answer.text or "")] if answer.text or not answer.calls else []
    return out + [{"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": c["id"],
                   "name": c["function"]["name"], "arguments": c["function"]["arguments"], "status": "completed"}
                  for c in answer.calls]


def usage(gen: Generation) -> dict[str, Any]:
    u = gen.usage
    return {"input_tokens": u.prompt_tokens, "input_tokens_details": {"cached_tokens": u.cached_tokens,
                                                                      "cache_write_tokens": u.cache_write_tokens},
            "output_tokens": u.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": u.prompt_tokens + u.completion_tokens}
