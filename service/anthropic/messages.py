"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the one request pipeline.

A Messages request is translated into a chat request (service/anthropic/translate.py) and runs the pipeline's
stages (service/openai/pipeline.py: parse, limits, tokenize through the chat template, salt, submit); this module
adds what is Anthropic's own: the cache_control breakpoints as leases (`Prepared.holds`, taken when the request
ends, as prompt_cache_key's), the answer's shape (`MessageShaper`: content blocks, stop_reason, usage), the
event stream (service/anthropic/events.py) and the miss diagnosis (service/cache_diagnosis.py).

Usage, as Anthropic defines it:

    cache_read_input_tokens       prompt tokens read from the prefix cache (whole blocks)
    cache_creation_input_tokens   prompt tokens up to a breakpoint that this request computed and now holds
                                  as a lease (whole blocks); cache_creation splits them by the TTL of the first
                                  breakpoint at or after each token
    input_tokens                  the rest: prompt - read - creation
"""
from __future__ import annotations

import json
import logging
from typing import Any

from aiohttp import web

from service.anthropic import translate
from service.anthropic.events import MessageFrames
from service.anthropic.schema import CountTokensRequest, MessagesRequest
from service.anthropic.translate import tool_use_id
from service.cache_diagnosis import FINGERPRINTS, Diagnosis, compare, fingerprint, live_leases, owner_of
from service.errors import ApiError, invalid
from service.openai import pipeline
from service.openai.generation import ChoiceDelta, Generation
from service.openai.pipeline import Prepared, read_body
from service.openai.schema import parse_model
from service.state import STATE, Ready
from service.tenants import caller_of

log = logging.getLogger(__name__)
DIAGNOSIS_BETA = "cache-diagnosis-2026-04-07"
_PARAMS = {"stop": "stop_sequences", "prompt_cache_options": "max_tokens", "cache_salt": "cache_salt"}


def setup(app: web.Application) -> None:
    app.router.add_post("/v1/messages", create_message)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)


async def _prepare(request: web.Request, ready: Ready, raw: bytes,
                   body: MessagesRequest | CountTokensRequest) -> Prepared:
    chat = translate.chat_body(body)
    points = translate.breakpoints(body) if isinstance(body, MessagesRequest) else []
    if isinstance(body, MessagesRequest) and body.max_tokens == 0:
        if not points:
            raise invalid("max_tokens must be at least 1 (0 is a cache warm-up: it needs a cache_control "
                          "breakpoint)", "max_tokens")
        chat["prompt_cache_options"] = {"prewarm": True}
    try:
        prepared = await pipeline.prepare(ready, chat, chat=True, caller=caller_of(request), size=len(raw))
    except ApiError as exc:              # named as this API names the field
        exc.param = _PARAMS.get(exc.param or "", exc.param)
        raise
    if points:
        plan = prepared.req.tools
        render_tools = plan is not None and plan.mode == "auto"
        salt = prepared.caller.salt(prepared.req.cache_salt)
        at = await ready.tokenizers.run(len(raw), ready.engine.tokenizer, lambda tok: translate.positions(
            points, prepared.prompts[0], tok, render_tools, ready.tokenizers.segments, salt))
        prepared.holds = [(n, p.ttl) for n, p in zip(at, points)]
    return prepared


async def count_tokens(request: web.Request) -> web.Response:
    ready = request.app[STATE].ready()
    raw = await read_body(request, ready.config.body_timeout)
    ignored: list[str] = []
    body: CountTokensRequest = await ready.tokenizers.run(len(raw), ready.engine.tokenizer, lambda _: parse_model(
        CountTokensRequest, raw, ready.config.strict_fields, ignored))
    prepared = await _prepare(request, ready, raw, body)
    return web.json_response({"input_tokens": len(prepared.prompts[0])}, headers=pipeline.ignored_fields(ignored))


async def create_message(request: web.Request) -> web.StreamResponse:
    ready = request.app[STATE].ready()
    with ready.engine.arriving():
        raw = await read_body(request, ready.config.body_timeout)
        ignored: list[str] = []
        body: MessagesRequest = await ready.tokenizers.run(len(raw), ready.engine.tokenizer, lambda _: parse_model(
            MessagesRequest, raw, ready.config.strict_fields, ignored))
        prepared = await _prepare(request, ready, raw, body)
    return await pipeline.answer(request, prepared, MessageShaper(request, prepared, body),
                                 pipeline.ignored_fields(ignored))


class MessageShaper:
    """The Messages API's shape of one generation (one choice)."""

    def __init__(self, request: web.Request, prepared: Prepared, body: MessagesRequest) -> None:
        self.prepared = prepared
        self.request = body
        self.model = prepared.ready.model_name
        self.block = prepared.ready.engine.block_size
        self.stops = set(body.stop_sequences or [])
        self.owner = owner_of(request)
        self.fingerprints = request.app[FINGERPRINTS]
        beta = {b.strip() for b in request.headers.get("anthropic-beta", "").split(",")}
        self.diagnose = body.diagnostics is not None or DIAGNOSIS_BETA in beta
        self._diagnosis: Diagnosis | None = None

    def id(self, gen: Generation) -> str:
        return f"msg_{gen.id}"

    # -- usage --------------------------------------------------------------------------------------------
    def usage(self, gen: Generation, final: bool) -> dict[str, Any]:
        """Anthropic's usage (the module docstring). Before the leases are taken (`final` false: a stream's
        message_start) creation counts every breakpoint as held."""
        prepared, b = self.prepared, self.block
        prompt = len(prepared.prompts[0])
        read = gen.cached_tokens
        held = prepared.held if final else [""] * len(prepared.holds)
        by_ttl = {300.0: 0, 3600.0: 0}
        end = read
        for (tokens, ttl), key in sorted(zip(prepared.holds, held), key=lambda h: h[0][0]):
            whole = tokens // b * b
            if key is not None and whole > end:
                by_ttl[ttl if ttl in by_ttl else 300.0] += whole - end
                end = whole
        created = sum(by_ttl.values())
        return {"input_tokens": max(prompt - read - created, 0), "output_tokens": gen.usage.completion_tokens,
                "cache_creation_input_tokens": created, "cache_read_input_tokens": read,
                "cache_creation": {"ephemeral_5m_input_tokens": by_ttl[300.0],
                                   "ephemeral_1h_input_tokens": by_ttl[3600.0]},
                "service_tier": "standard"}

    # -- diagnostics ----------------------------------------------------------------------------------------
    def diagnostics(self, gen: Generation) -> dict[str, Any] | None:
        """The `diagnostics` object (when asked for): the first difference from the request named by
        diagnostics.previous_message_id, or null when nothing was missed."""
        previous = self.request.diagnostics.previous_message_id if self.request.diagnostics is not None else None
        if previous is None:
            return None
        if self._diagnosis is None:
            store, prepared = self.fingerprints, self.prepared
            cur = fingerprint(store, self.owner, prepared, *translate.sections(self.request))
            self._diagnosis = compare(store.get(previous, self.owner), cur, gen.cached_tokens,
                                      live_leases(prepared.ready.registry))
        return miss_reason(self._diagnosis)

    def remember(self, gen: Generation) -> None:
        """Keeps this request's fingerprint for a later request's diagnosis (asked for: Anthropic keeps one only
        for requests that carry `diagnostics`). Call once its leases are taken."""
        if self.diagnose:
            fp = fingerprint(self.fingerprints, self.owner, self.prepared, *translate.sections(self.request))
            self.fingerprints.put(self.id(gen), fp)

    # -- content ---------------------------------------------------------------------------------------------
    def stop(self, c: ChoiceDelta, calls: bool) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence)."""
        if c.finish_reason == "length":        # a call cut by max_tokens is no call to run (Anthropic's order)
            return "max_tokens", None
        if calls:
            return "tool_use", None
        if isinstance(c.stop_reason, str) and c.stop_reason in self.stops:
            return "stop_sequence", c.stop_reason
        return "end_turn", None

    def blocks(self, text: str) -> tuple[list[dict[str, Any]], bool]:
        """The content blocks of a whole answer, and whether it called tools."""
        plan = self.prepared.req.tools
        content, calls = plan.calls(text) if plan is not None else (text, [])
        out: list[dict[str, Any]] = [{"type": "text", "text": content}] if content else []
        called = False
        for call in calls:
            try:
                args = json.loads(call.arguments)
            except ValueError:          # a forced call cut short by max_tokens: not a whole object
                out.append({"type": "text", "text": call.arguments})
                continue
            out.append({"type": "tool_use", "id": tool_use_id(call.id), "name": call.name,
                        "input": args if isinstance(args, dict) else {"value": args}})
            called = True
        return out, called

    def head(self, gen: Generation) -> dict[str, Any]:
        return {"id": self.id(gen), "type": "message", "role": "assistant", "model": self.model}

    def frames(self, gen: Generation) -> MessageFrames:
        return MessageFrames(self, gen)

    def body(self, gen: Generation, choices: list[ChoiceDelta]) -> dict[str, Any]:
        c = choices[0]
        content, called = self.blocks(c.text)
        reason, sequence = self.stop(c, called)
        out = {**self.head(gen), "content": content, "stop_reason": reason, "stop_sequence": sequence,
               "usage": self.usage(gen, final=True)}
        if self.diagnose:
            out["diagnostics"] = self.diagnostics(gen)
        self.remember(gen)
        return out


_ANTHROPIC_REASON = {"model": "model_changed", "system": "system_changed", "tools": "tools_changed",
                     "message": "messages_changed", "salt": "cache_salt_changed", "expired": "cache_expired",
                     "evicted": "cache_evicted"}


def miss_reason(d: Diagnosis) -> dict[str, Any] | None:
    """Anthropic's diagnostics object; null when the cache gave all it could."""
    if d.reason == "hit":
        return None
    if d.reason == "not_found":
        return {"cache_miss_reason": {"type": "previous_message_not_found"}}
    if d.reason == "unavailable":
        return {"cache_miss_reason": {"type": "unavailable"}}
    reason: dict[str, Any] = {"type": _ANTHROPIC_REASON[d.reason], "cache_missed_input_tokens": d.missed}
    if d.message_index is not None:
        reason["message_index"] = d.message_index
    return {"cache_miss_reason": reason}
