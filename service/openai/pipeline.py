"""The one request pipeline of the generation surfaces: chat, completions, the WebSocket's `generate` and
the router's render all take the same stages, in this order, each stage in one module:

    stage       where                                    refuses with              runs on
    ready       ServiceState.ready (service/state.py)    503 warming/draining/dead event loop
    read        read_body (here)                         408 slow body, 413        event loop
    parse       params.parse (schema.py's models)        400 naming the field      tokenizer thread (*)
    prefix      PrefixRegistry.snapshot (prefix_store)   404 unknown prefix        event loop
                (the caller's own, else a published one)
    limits      check_choices (here)                     400 too many choices      event loop
    tokenize    check_prompt_chars (here), then          400 too much text,        tokenizer thread (*)
                render.tokenize (chat template, prefix)  400
    salt        tenants.cache_salt (the caller's tenant) -                         event loop
    submit      Generation.begin (AsyncEngine.add)       400 (a grammar that does  event loop (grammars
                                                         not compile in time),     compile on the engine's
                                                         429, 503                  grammar threads)
    answer      answer (here): sse.stream in the         (errors after the headers: the surface's
                surface's Frames, or Generation.collect  error event)
                and the surface's body

(*) a body of --large-body-bytes or more: the large bodies' tokenizer thread (service/tokenizer_threads.py).

When a request with `prompt_cache_key` ends, its prompt's common prefix with the key's earlier prompts is
leased (prefix_store/leases.py): a whole answer waits for the lease (so `max_tokens: 0` warms the
cache and says so), a stream does not. So are a request's `holds` (Anthropic's cache_control breakpoints:
its prompt's first N tokens, for a TTL) and a pre-warm's prompt (`prompt_cache_options.prewarm`).

A surface hands the pipeline only its shaping (a Shaper: the frames of a stream, the body of a whole
answer): on its way to the engine a request enters each module once. Chat and completions take `serve`;
the Responses API parses and translates its own body, then takes `prepare` and `answer` (so a whole
Responses answer waits for its lease, and its stream ends through sse.stream's guard, as chat's). The
WebSocket and the render endpoints take `prepare` (and `submit`) and answer in their own shape.

A body that takes seconds to parse, render or tokenize (hundreds of prompts, a long conversation) would
stall every stream and /health on the loop, so those stages run on a tokenizer thread; the registry
belongs to the loop, so the prefix is looked up there, between the two, and handed over as an immutable
snapshot.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from aiohttp import web

from engine.errors import EngineError
from engine.sequence import SamplingParams
from prefix_store.errors import PrefixNotFound, RegistryError
from prefix_store.local import PrefixSnapshot
from prefix_store.registry import PrefixRegistry
from service.errors import ApiError, invalid
from service.middleware.access_log import record_usage
from service.middleware.metrics import METRICS, Metrics
from service.openai import params, render, sse
from service.openai.generation import ChoiceDelta, Generation
from service.openai.params import GenerationRequest, Parsed
from service.openai.schema import CompletionRequest
from service.state import STATE, Ready
from service.tenants import Caller, cache_salt, caller_of
from service.usage import Usage

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
    caller who may not read its source: prefix_store/access.py; 0 otherwise). Every path that returns tokens
    or text of the prompt (render, echo, prompt token ids, prompt logprobs) leaves them out. `foreign[i]`:
    the same for any key of the caller's tenant, admin or not: what a prompt_cache_key lease may not record."""

    parsed: Parsed
    prompts: list[list[int]]
    ready: Ready
    caller: Caller
    prefix: PrefixSnapshot | None = None
    lease: asyncio.Task[None] | None = None     # the leases it asked for, once the generation ended
    # (tokens, ttl seconds): its prompt's first `tokens` held as a lease (cache_control breakpoints); `held`:
    # each one's lease key, None where the caps refused it, filled in by the lease task
    holds: list[tuple[int, float]] = field(default_factory=list)
    held: list[str | None] = field(default_factory=list)
    hidden: list[int] = field(default_factory=list)
    foreign: list[int] = field(default_factory=list)
    echo: list[str] | None = None       # completions' echo: each prompt's text as the caller may see it

    def shown(self, i: int) -> list[int]:
        """Prompt i's tokens as this caller may see them."""
        return self.prompts[i][self.hidden[i] if self.hidden else 0:]

    @property
    def req(self) -> GenerationRequest:
        return self.parsed.req


class Shaper(Protocol):
    """A surface's shaping of one generation's answer."""

    def frames(self, gen: Generation) -> sse.Frames: ...       # a streamed answer (sse.stream writes it)

    def body(self, gen: Generation, choices: list[ChoiceDelta]) -> dict[str, Any]: ...  # a whole one, usage in


class ChunkShaper:
    """Chat's and completions' common shaping: OpenAI chunks (`head` + `chunks`) as `data:` events with the
    usage chunk and [DONE] (sse.DataFrames), stream_options honoured."""

    req: GenerationRequest

    def head(self, gen: Generation) -> dict[str, Any]:
        raise NotImplementedError

    def chunks(self, gen: Generation, d: ChoiceDelta) -> list[dict[str, Any]]:
        raise NotImplementedError

    def frames(self, gen: Generation) -> sse.Frames:
        usage_chunk = {**self.head(gen), "choices": []} if self.req.include_usage else None
        if self.req.continuous_usage:
            return sse.DataFrames(gen, lambda d: [{**c, "usage": gen.usage.as_dict()} for c in self.chunks(gen, d)],
                                  usage_chunk)
        return sse.DataFrames(gen, lambda d: self.chunks(gen, d), usage_chunk)


async def prepare(ready: Ready, raw: bytes | dict[str, Any], chat: bool, caller: Caller,
                  size: int | None = None) -> Prepared:
    """parse -> prefix -> limits -> tokenize -> salt (the module docstring's stages). A body of
    --large-body-bytes or more takes the large bodies' tokenizer thread (service/tokenizer_threads.py); an
    object (a WebSocket message, a Responses conversation) goes by `size`, the bytes it came from (unknown:
    the tokenizer thread). A named prefix's tokens the caller may not read (prefix_store/access.py: a published
    prefix's for a user, a lease's published head) are hidden (`Prepared.hidden`) from whatever the answer
    shows of the prompt."""
    config, run = ready.config, ready.tokenizers.run
    size = len(raw) if isinstance(raw, bytes) else (size or 0)
    tokenizer = ready.engine.tokenizer
    parsed = await run(size, tokenizer, lambda _: params.parse(raw, chat, ready.model_name, config.max_choices,
                                                               config.strict_fields))
    prefix = _snapshot(ready, parsed.req.prefix, caller)
    check_choices(parsed.num_prompts, parsed.req.params, config.max_choices)
    ttl = parsed.req.cache_ttl
    if ttl is not None and ttl > config.max_lease_seconds:
        raise invalid(f"the prompt cache lifetime asked for ({ttl:g} s) is over this server's longest lease "
                      f"({config.max_lease_seconds:g} s)", "prompt_cache_options")

    def tokenize(tok: Any) -> list[list[int]]:
        check_prompt_chars(*_prompt_texts(parsed), config.max_prompt_chars)
        return render.tokenize(parsed, tok, prefix, ready.tokenizers.segments, caller.salt(parsed.req.cache_salt))
    prompts = await run(size, tokenizer, tokenize)
    check_echo_logprobs(prompts, parsed.req, config.max_echo_logprobs)
    parsed.req.params.cache_salt = cache_salt(caller, parsed.req.cache_salt, prefix, ready.engine.block_size)
    hidden = [_hidden(p, prefix, prefix.hidden) if prefix else 0 for p in prompts]
    foreign = [_hidden(p, prefix, prefix.foreign) if prefix else 0 for p in prompts]
    prepared = Prepared(parsed, prompts, ready, caller, prefix, hidden=hidden, foreign=foreign)
    if parsed.req.echo:     # decoding a hundred long prompts takes a while: the tokenizer thread's work
        prepared.echo = await run(size, tokenizer, lambda tok: _echo(prepared, tok))
    return prepared


def _prompt_texts(parsed: Parsed) -> tuple[list[str], str]:
    body = parsed.body
    if isinstance(body, CompletionRequest):
        prompt = body.prompt
        return ([prompt] if isinstance(prompt, str) else [p for p in prompt if isinstance(p, str)]), "prompt"
    return [m.text() for m in body.messages], "messages"


def check_prompt_chars(texts: list[str], param: str, limit: int) -> None:
    """Before any tokenizing: the text a request would have tokenized, at most `limit` characters in all."""
    chars = sum(len(t) for t in texts)
    if chars > limit:
        raise invalid(f"the {param} hold {chars} characters of text; this server tokenizes at most {limit} per "
                      "request (--max-prompt-chars)", param)


def _hidden(prompt: list[int], prefix: PrefixSnapshot, count: int) -> int:
    """The leading tokens of `prompt` not to show when the prefix's first `count` are not to be shown. A chat
    template that rendered the prefix's messages into other tokens (registration checks this does not
    happen) hides the whole prompt: where the prefix's text went is then unknown."""
    if count == 0:
        return 0
    return count if tuple(prompt[:len(prefix.token_ids)]) == prefix.token_ids else len(prompt)


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


def _snapshot(ready: Ready, name: str | None, caller: Caller) -> PrefixSnapshot | None:
    if name is None:
        return None
    if ready.registry is None:
        raise PrefixNotFound(f"prefix {name!r} is not registered", param="prefix")
    return ready.registry.snapshot(name, caller.reader)


def check_choices(num_prompts: int, sampling: SamplingParams, max_choices: int) -> None:
    """Prompts x best_of (the sequences generated) is capped like prompts x n (those returned)."""
    best_of = sampling.best_of or sampling.n
    if num_prompts * best_of > max_choices:
        param = "best_of" if best_of > sampling.n else "n"
        raise invalid(f"the number of prompts times {param} must be at most {max_choices}", param)


def _on_finish(prepared: Prepared) -> Callable[[Usage], Any] | None:
    """When a request ends: one that named a prefix is counted against it (the per-prefix metrics, its
    lease); one with prompt_cache_key leases its prompt's common prefix with the key's earlier ones."""
    registry, prefix, req = prepared.ready.registry, prepared.prefix, prepared.req
    ttl = req.cache_ttl or prepared.ready.config.prompt_cache_ttl
    if req.prewarm and req.cache_key is None and not prepared.holds and prepared.prompts:
        prepared.holds = [(len(prepared.prompts[0]), ttl)]     # a pre-warm without a key holds its whole prompt
    if registry is None or (prefix is None and req.cache_key is None and not prepared.holds):
        return None

    def finished(usage: Usage) -> None:
        if prefix is not None:
            registry.record_use(prefix.key, usage.cached_tokens)
        if (req.cache_key is not None or prepared.holds) and prepared.prompts:
            prepared.lease = asyncio.create_task(_lease(registry, prepared, req.cache_key, ttl))
    return finished


async def _lease(registry: PrefixRegistry, prepared: Prepared, key: str | None, ttl: float) -> None:
    """Best effort: a lease the caps refuse (pinned blocks, prefixes per tenant) leaves the cache as it is."""
    caller, prompt = prepared.caller, prepared.prompts[0]
    salt, foreign = prepared.req.params.cache_salt, prepared.foreign[0]
    try:
        if key is not None:
            await registry.leases.cache_key(caller.owner, salt, key, prompt, ttl, foreign)
    except (EngineError, RegistryError) as exc:
        log.info("prompt_cache_key lease not kept: %s", exc)
    prepared.held = []
    for tokens, hold_ttl in prepared.holds:
        try:
            prepared.held.append(await registry.leases.content(caller.owner, salt, prompt[:tokens], hold_ttl, foreign))
        except (EngineError, RegistryError) as exc:
            log.info("cache_control lease not kept: %s", exc)
            prepared.held.append(None)


async def leased(prepared: Prepared) -> None:
    """Waits for the leases a finished request asked for (none: returns at once)."""
    if prepared.lease is not None:
        await asyncio.shield(prepared.lease)


async def submit(prepared: Prepared, metrics: Metrics) -> Generation:
    """A prepared request's Generation, its engine requests admitted (else the refusal is raised and
    nothing is left running). The caller closes it."""
    return await Generation.begin(prepared.ready.engine, prepared.prompts, prepared.req.params, metrics,
                                  _on_finish(prepared), echo=prepared.echo, hidden=prepared.hidden,
                                  tenant=prepared.caller.tenant or "")


def generation(prepared: Prepared, metrics: Metrics) -> Generation:
    """The same, not started (the WebSocket starts it itself, so that a cancel can reach it at once)."""
    return Generation(prepared.ready.engine, prepared.prompts, prepared.req.params, metrics, _on_finish(prepared),
                      echo=prepared.echo, hidden=prepared.hidden, tenant=prepared.caller.tenant or "")


def _echo(prepared: Prepared, tokenizer: Any) -> list[str]:
    """Completions' `echo`: each prompt's text as the client wrote it (decoded when a prefix the caller may read
    went first, from where it may read; a prefix it may not read at all is left out: its own prompt only)."""
    body, prefix = prepared.parsed.body, prepared.prefix
    texts: list[str] = []
    if isinstance(body, CompletionRequest):
        prompt = body.prompt
        texts = [prompt] if isinstance(prompt, str) else [p for p in prompt if isinstance(p, str)]
    own = len(texts) == len(prepared.prompts)
    return [texts[i] if own and (prefix is None or prepared.hidden[i] >= len(prefix.token_ids))
            else tokenizer.decode(prepared.shown(i)) for i in range(len(prepared.prompts))]


async def serve(request: web.Request, chat: bool, shaper: Callable[[Prepared], Shaper]) -> web.StreamResponse:
    """A whole HTTP generation request of chat or completions: every stage, then SSE or one JSON answer."""
    ready = request.app[STATE].ready()
    with ready.engine.arriving():       # a burst of requests is prefilled together (AsyncEngine.arriving)
        raw = await read_body(request, ready.config.body_timeout)
        prepared = await prepare(ready, raw, chat, caller_of(request))
    return await answer(request, prepared, shaper(prepared), ignored_fields(prepared.parsed.ignored))


async def answer(request: web.Request, prepared: Prepared, shape: Shaper,
                 headers: dict[str, str]) -> web.StreamResponse:
    """submit -> answer: a stream in the surface's frames, or its body once the generation ended and its
    prompt_cache_key lease is pinned."""
    config = prepared.ready.config
    gen = await submit(prepared, request.app[METRICS])      # adds before its first await: no gap to miss
    try:
        if prepared.req.stream:
            return await sse.stream(request, gen, shape.frames(gen), config.keepalive_interval,
                                    config.write_timeout, headers)
        choices = await gen.collect()
        await leased(prepared)
        text = await sse.shaped(sum(len(c.token_ids) for c in choices), lambda: sse.dumps(shape.body(gen, choices)))
        return web.json_response(text=text, headers=headers)
    finally:
        gen.close()
        record_usage(request, gen.usage)
