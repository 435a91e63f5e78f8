"""The one request pipeline of the generation surfaces: chat, completions, the WebSocket's `generate` and
the router's render all take the same stages, in this order, each stage in one module:

    stage       where                                    refuses with              runs on
    ready       ServiceState.ready (service/state.py)    503 warming/draining/dead event loop
    read        read_body (here)                         408 slow body, 413        event loop
    parse       params.parse (schema.py's models)        400 naming the field      tokenizer thread
    prefix      PrefixRegistry.snapshot (prefix_store)   404 unknown prefix        event loop
    limits      check_choices (here)                     400 too many choices      event loop
    tokenize    render.tokenize (chat template, prefix)  400                       tokenizer thread
    submit      Generation.begin (AsyncEngine.add)       400 (a grammar that does  event loop (grammars
                                                         not compile), 429, 503    compile on the engine's
                                                                                   grammar thread)
    answer      the surface's Shaper: sse.stream, or     (errors after the headers: an SSE error event)
                Generation.collect

A surface hands the pipeline only its shaping (a Shaper: the id/object head, the chunks of one delta,
the body of a whole answer), made once the request is submitted: on its way to the engine a request
enters each module once. The WebSocket and the render endpoints take `prepare` (and `submit`) and answer
in their own shape. A body that takes seconds to parse, render or tokenize (hundreds of prompts,
a long conversation) would stall every stream and /health on the loop, so those stages run on the one
tokenizer thread; the registry belongs to the loop, so the prefix is looked up there, between the two,
and handed over as an immutable snapshot.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from aiohttp import web

from engine.sequence import SamplingParams
from prefix_store.errors import PrefixNotFound
from prefix_store.registry import PrefixSnapshot
from service.errors import ApiError, invalid
from service.middleware.access_log import record_usage
from service.middleware.auth import is_admin
from service.middleware.metrics import METRICS, Metrics
from service.openai import params, render, sse
from service.openai.generation import ChoiceDelta, Generation, Usage
from service.openai.params import GenerationRequest, Parsed
from service.openai.schema import CompletionRequest
from service.state import STATE, Ready

T = TypeVar("T")
log = logging.getLogger(__name__)
IGNORED_HEADER = "X-Ignored-Fields"     # the unknown fields a request sent, dropped (schema.py's field policy)


async def off_loop(executor: ThreadPoolExecutor, fn: Callable[[], T]) -> T:
    return await asyncio.get_running_loop().run_in_executor(executor, fn)


async def read_body(request: web.Request, timeout: float) -> bytes:
    """The raw body; 413 (client_max_size) surfaces as HTTPRequestEntityTooLarge, a body that takes
    longer than `timeout` seconds to arrive gets 408."""
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s", code="body_timeout") from None


@dataclass
class Prepared:
    """A request through parse, prefix, limits and tokenize: ready to submit.

    `hidden[i]`: how many leading tokens of prompt i this caller may not be shown (a named prefix's, for a
    caller who may not read its source; 0 otherwise). Every path that returns tokens or text of the prompt
    (render, echo, prompt token ids, prompt logprobs) leaves them out."""

    parsed: Parsed
    prompts: list[list[int]]
    ready: Ready
    hidden: list[int] = field(default_factory=list)
    echo: list[str] | None = None       # completions' echo: each prompt's text as the caller may see it

    def shown(self, i: int) -> list[int]:
        """Prompt i's tokens as this caller may see them."""
        return self.prompts[i][self.hidden[i] if self.hidden else 0:]

    @property
    def req(self) -> GenerationRequest:
        return self.parsed.req


class Shaper(Protocol):
    """A surface's shaping of one generation's answer (chat and completions each have one)."""

    def head(self, gen: Generation) -> dict[str, Any]: ...          # id, object, created, model

    def chunks(self, gen: Generation, delta: ChoiceDelta) -> list[dict[str, Any]]: ...   # one delta -> SSE chunks

    def body(self, gen: Generation, choices: list[ChoiceDelta]) -> dict[str, Any]: ...  # all choices -> JSON


async def prepare(ready: Ready, raw: bytes | dict[str, Any], chat: bool, *, may_read_prefix: bool) -> Prepared:
    """parse -> prefix -> limits -> tokenize (the module docstring's stages). `may_read_prefix`: whether the
    caller may read a named prefix's source (service/middleware/auth.py: an admin); if not, the prefix's
    tokens are hidden from whatever the answer shows of the prompt (`Prepared.hidden`)."""
    max_choices = ready.config.max_choices
    parsed = await off_loop(ready.executor, lambda: params.parse(raw, chat, ready.model_name, max_choices,
                                                                 ready.config.strict_fields))
    prefix = _snapshot(ready, parsed.req.prefix)
    check_choices(parsed.num_prompts, parsed.req.params, max_choices)
    tokenizer = ready.engine.tokenizer
    prompts = await off_loop(ready.executor, lambda: render.tokenize(parsed, tokenizer, prefix))
    check_echo_logprobs(prompts, parsed.req, ready.config.max_echo_logprobs)
    hidden = [0] * len(prompts) if prefix is None or may_read_prefix else [_hidden(p, prefix) for p in prompts]
    prepared = Prepared(parsed, prompts, ready, hidden)
    if parsed.req.echo:     # decoding a hundred long prompts takes a while: the tokenizer thread's work
        prepared.echo = await off_loop(ready.executor, lambda: _echo(prepared, tokenizer))
    return prepared


def _hidden(prompt: list[int], prefix: PrefixSnapshot) -> int:
    """The leading tokens of `prompt` that are the prefix's. A chat template that rendered the prefix's messages
    into other tokens (registration checks this does not happen) hides the whole prompt: where the prefix's
    text went is then unknown."""
    head = len(prefix.token_ids)
    return head if tuple(prompt[:head]) == prefix.token_ids else len(prompt)


def check_echo_logprobs(prompts: list[list[int]], req: GenerationRequest, limit: int) -> None:
    """Completions' echo with logprobs returns, for every choice, an entry per prompt token with its top
    alternatives: prompt tokens x choices x (logprobs + 1) entries, capped (`--max-echo-logprobs`)."""
    k = req.params.prompt_logprobs
    if not req.echo or k is None:
        return
    entries = sum(len(p) for p in prompts) * req.params.n * (k + 1)
    if entries > limit:
        raise invalid(f"echo with logprobs would return {entries} log-probabilities (prompt tokens x n x "
                      f"(logprobs + 1)); this server returns at most {limit} (--max-echo-logprobs): send a "
                      "shorter prompt, fewer prompts, or a smaller logprobs", "logprobs")


def ignored_fields(names: list[str]) -> dict[str, str]:
    """The warning for a request's unknown fields (schema.parse_model): a log line, and the header to send."""
    if not names:
        return {}
    log.warning("request fields not known to this server were ignored: %s", ", ".join(names))
    return {IGNORED_HEADER: ", ".join(names)}


def _snapshot(ready: Ready, name: str | None) -> PrefixSnapshot | None:
    if name is None:
        return None
    if ready.registry is None:
        raise PrefixNotFound(f"prefix {name!r} is not registered", param="prefix")
    return ready.registry.snapshot(name)


def check_choices(num_prompts: int, sampling: SamplingParams, max_choices: int) -> None:
    """Prompts x best_of (the sequences generated) is capped like prompts x n (those returned)."""
    best_of = sampling.best_of or sampling.n
    if num_prompts * best_of > max_choices:
        param = "best_of" if best_of > sampling.n else "n"
        raise invalid(f"the number of prompts times {param} must be at most {max_choices}", param)


def _on_finish(prepared: Prepared) -> Callable[[Usage], Any] | None:
    """A request that named a prefix is counted against it when it ends (the per-prefix metrics)."""
    registry, name = prepared.ready.registry, prepared.req.prefix
    if registry is None or name is None:
        return None
    return lambda usage: registry.record_use(name, usage.cached_tokens)


async def submit(prepared: Prepared, metrics: Metrics) -> Generation:
    """A prepared request's Generation, its engine requests admitted (else the refusal is raised and
    nothing is left running). The caller closes it."""
    return await Generation.begin(prepared.ready.engine, prepared.prompts, prepared.req.params, metrics,
                                  _on_finish(prepared), echo=prepared.echo, hidden=prepared.hidden)


def generation(prepared: Prepared, metrics: Metrics) -> Generation:
    """The same, not started (the WebSocket starts it itself, so that a cancel can reach it at once)."""
    return Generation(prepared.ready.engine, prepared.prompts, prepared.req.params, metrics, _on_finish(prepared),
                      echo=prepared.echo, hidden=prepared.hidden)


def _echo(prepared: Prepared, tokenizer: Any) -> list[str]:
    """Completions' `echo`: each prompt's text as the client wrote it (decoded when a prefix went first; a
    prefix the caller may not read is left out: its own prompt only)."""
    req, body = prepared.req, prepared.parsed.body
    if (req.prefix is None or any(prepared.hidden)) and isinstance(body, CompletionRequest):
        prompt = body.prompt
        texts = [prompt] if isinstance(prompt, str) else [p for p in prompt if isinstance(p, str)]
        if len(texts) == len(prepared.prompts):
            return texts
    return [tokenizer.decode(prepared.shown(i)) for i in range(len(prepared.prompts))]


async def serve(request: web.Request, chat: bool, shaper: Callable[[Prepared], Shaper]) -> web.StreamResponse:
    """A whole HTTP generation request: every stage, then SSE or one JSON answer."""
    ready = request.app[STATE].ready()
    with ready.engine.arriving():       # a burst of requests is prefilled together (AsyncEngine.arriving)
        raw = await read_body(request, ready.config.body_timeout)
        prepared = await prepare(ready, raw, chat, may_read_prefix=is_admin(request))
    gen = await submit(prepared, request.app[METRICS])      # adds before its first await: no gap to miss
    headers = ignored_fields(prepared.parsed.ignored)
    try:
        shape = shaper(prepared)
        if prepared.req.stream:
            usage_chunk = {**shape.head(gen), "choices": []} if prepared.req.include_usage else None
            chunks = (lambda d: [{**c, "usage": gen.usage.as_dict()} for c in shape.chunks(gen, d)]) \
                if prepared.req.continuous_usage else (lambda d: shape.chunks(gen, d))
            return await sse.stream(request, gen, chunks, usage_chunk, ready.config.keepalive_interval, headers)
        choices = await gen.collect()
        text = await sse.shaped(sum(len(c.token_ids) for c in choices), lambda: sse.dumps(
            {**shape.body(gen, choices), "usage": gen.usage.as_dict()}))
        return web.json_response(text=text, headers=headers)
    finally:
        gen.close()
        record_usage(request, gen.usage)
