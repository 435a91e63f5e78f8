"""What a router in front of replicas asks of a worker, answered from this replica's own state.

vllm-router 0.1.17 (the router of compose.yaml; its --help, source and debug logs on loopback) calls:

    GET  /health                       readiness, at start (it waits for every worker) and every
                                       --health-check-interval-secs; non-200 marks the worker unhealthy
    POST /v1/completions/render        token ids of a request before routing it (cache_aware, kv_aware:
    POST /v1/chat/completions/render   "prefix input preparation"); vLLM's shape: a list of
                                       GenerateRequest for completions, one for chat
    POST /tokenize                     its fallback when render answers an error (service/routes/tokens.py)
    GET  /get_server_info              kv_aware discovery: model_id, instance_id, kv_block_size
    GET  /kv_event_sources             kv_aware discovery: {"<dp rank>": vLLM's KVEventsConfig}
    GET  /get_load                     forwarded by its GET /get_loads: {"load": int, ...}
    GET  /get_model_info, /v1/models, /version, /health_generate, /metrics: forwarded to a worker
                                       (/v1/models and /version: service/routes/status.py)
    POST /flush_cache                  forwarded to every worker by its POST /flush_cache

Every answer comes from the engine (`AsyncEngine.stats()`, a snapshot the engine thread takes after
each step) or from this replica's configuration; nothing is a placeholder. /v1/*/render give the
exact token ids the generation endpoints would run, a named `prefix` included, so a router's
prefix-aware policy sees what the engine's prefix cache sees.
"""
from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import socket
import uuid
from pathlib import Path
from typing import Any

from aiohttp import web

from engine.config import KVEventsConfig
from engine.sequence import SamplingParams
from service import __version__
from service.errors import ApiError
from service.middleware.auth import is_admin
from service.openai.params import GenerationRequest
from service.openai.pipeline import prepare, read_body
from service.state import STATE
from service.tenants import caller_of


def setup(app: web.Application) -> None:
    for path, handler in GETS.items():
        app.router.add_get(path, handler)
    for path, handler in POSTS.items():
        app.router.add_post(path, handler)


def _events(request: web.Request) -> KVEventsConfig | None:
    text = request.app[STATE].ready_engine().config.kv_events_config
    return KVEventsConfig.from_json(text) if text else None


async def server_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.ready_engine()
    cfg = engine.config
    events = _events(request)
    # NOTE: no "block_size" key: vllm-router 0.1.17 reads it as kv_block_size too and rejects the body
    # ("duplicate field") when both are present.
    return web.json_response({
        "model_id": state.model_name, "served_model_name": state.model_name, "model_path": _model_path(request),
        "instance_id": f"{_host(request)}:{state.config.port}", "kv_block_size": engine.block_size,
        "max_model_len": engine.max_model_len, "max_num_seqs": cfg.max_num_seqs,
        "max_num_batched_tokens": cfg.max_num_batched_tokens, "num_kv_blocks": engine.stats().kv_blocks_total,
        "enable_prefix_caching": cfg.enable_prefix_caching,
        "fingerprint": engine.fingerprint if is_admin(request) else None,     # seeds every block hash: admins
        "device": cfg.device, "dtype": cfg.dtype, "attention_backend": engine.attention_backend,
        "kv_cache_dtype": engine.kv_cache_dtype,
        "kv_backend": cfg.kv_backend,
        "kernels": engine.kernels,
        "kv_events_config": dataclasses.asdict(events) if events is not None else None,
        "version": __version__})


def _model_path(request: web.Request) -> str:
    """The checkpoint's path for an admin (the router, an operator); its file name only for a user key: the
    host's directory layout is not theirs to read."""
    path = str(request.app[STATE].ready_engine().model_path)
    return path if is_admin(request) else Path(path).name


def _host(request: web.Request) -> str:
    """The host name for an admin; for a user key a stable digest of it (still one id per replica)."""
    name = socket.gethostname()
    return name if is_admin(request) else "h" + hashlib.sha256(name.encode()).hexdigest()[:12]


async def model_info(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.ready_engine()
    path = _model_path(request)
    return web.json_response({"model_path": path, "tokenizer_path": path, "is_generation": True,
                              "served_model_name": state.model_name, "max_model_len": engine.max_model_len})


async def load(request: web.Request) -> web.Response:
    """`load`: requests in the engine (running + waiting), the number vllm-router reads."""
    s = request.app[STATE].ready_engine().stats()
    return web.json_response({
        "load": s.requests_running + s.requests_waiting, "num_running_reqs": s.requests_running,
        "num_waiting_reqs": s.requests_waiting, "kv_blocks_used": s.kv_blocks_used,
        "kv_blocks_total": s.kv_blocks_total, "kv_cache_usage": s.kv_blocks_used / s.kv_blocks_total})


async def kv_event_sources(request: web.Request) -> web.Response:
    """This replica's KV event publisher, keyed by data-parallel rank (one: "0"); {} when events are off."""
    events = _events(request)
    if events is None or not events.enabled:
        return web.json_response({})
    return web.json_response({"0": dataclasses.asdict(events)})


async def health_generate(request: web.Request) -> web.Response:
    """Liveness through the whole engine: one greedy token from a one-token prompt."""
    engine = request.app[STATE].ready_engine()
    bos = engine.tokenizer.bos_token_id
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    try:
        # NOTE: a timeout cancels the pending __anext__ inside the generator, whose finally aborts the request.
        async with asyncio.timeout(30):
            async for out in engine.generate([bos if bos is not None else 0], params):
                if out.finished and out.error is None and out.outputs and out.outputs[0].token_ids:
                    return web.json_response({"status": "ok"})
    except TimeoutError:
        pass
    raise ApiError(503, "the engine did not generate a token", type="service_unavailable", code="health_generate")


def _generate_request(request_id: str, token_ids: list[int], req: GenerationRequest, model: str) -> dict[str, Any]:
    """vLLM's GenerateRequest shape (token in), with this engine's own sampling parameters (less the cache
    salt: the server's own, derived from the caller's tenant)."""
    params = dataclasses.asdict(req.params)
    del params["cache_salt"]
    return {"request_id": request_id, "token_ids": token_ids, "model": model, "stream": req.stream,
            "sampling_params": params}


async def _render(request: web.Request, chat: bool) -> list[dict[str, Any]]:
    """The GenerateRequest of each prompt. A named prefix whose source the caller may not read (a user key)
    is left out of `token_ids`: they start after it, and `num_hidden_prefix_tokens` says how many came
    before (the router, with an admin key, gets them whole)."""
    ready = request.app[STATE].ready()
    prepared = await prepare(ready, await read_body(request, ready.config.body_timeout), chat=chat,
                             caller=caller_of(request))
    rid = f"chatcmpl-{uuid.uuid4().hex}" if chat else f"cmpl-{uuid.uuid4().hex}"
    out = []
    for i, hidden in enumerate(prepared.hidden):
        one = _generate_request(rid if chat else f"{rid}-{i}", prepared.shown(i), prepared.req, ready.model_name)
        if hidden:
            one["num_hidden_prefix_tokens"] = hidden
        out.append(one)
    return out


async def render_completion(request: web.Request) -> web.Response:
    return web.json_response(await _render(request, chat=False))


async def render_chat(request: web.Request) -> web.Response:
    (one,) = await _render(request, chat=True)
    return web.json_response(one)


async def flush_cache(request: web.Request) -> web.Response:
    """SGLang's /flush_cache and vLLM's /reset_prefix_cache: every evictable cached block forgets its
    hash (pinned prefixes and running requests keep theirs); KV events announce it."""
    flushed = await request.app[STATE].ready_engine().reset_prefix_cache()
    return web.json_response({"flushed_blocks": flushed})


GETS = {"/get_server_info": server_info, "/get_model_info": model_info, "/get_load": load,
        "/kv_event_sources": kv_event_sources, "/health_generate": health_generate}
POSTS = {"/v1/completions/render": render_completion, "/v1/chat/completions/render": render_chat,
         "/flush_cache": flush_cache, "/reset_prefix_cache": flush_cache}

