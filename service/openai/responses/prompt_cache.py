"""The Responses API's prompt-cache options beyond the lease (service/openai/responses/api.py calls `finish` on every
answer it returns):

    prompt_cache_options.prewarm                 the prompt is written into the cache and held (a lease of
                                                 prompt_cache_options.ttl, else --prompt-cache-ttl; with
                                                 prompt_cache_key, that key's lease), nothing generated
                                                 (max_output_tokens 0); the answer comes once the blocks are
                                                 pinned: status "completed", no output, and the tokens written
                                                 in usage.input_tokens_details.cache_write_tokens
    prompt_cache_options.comparison_response_id  `prompt_cache_diagnostics` (OpenAI's shape): why this
                                                 request read less from the cache than that response left
                                                 (service/cache_diagnosis.py)

    diagnosis        prompt_cache_diagnostics
    no such id       {"type": "comparison_response_not_found"}  (another key's response too)
    all read         {"type": "cache_hit"}
    a difference     {"type": "cache_miss", "reason", "cache_missed_tokens", "comparison_reusable_tokens"}
                     reason: model_changed, tools_changed, instructions_changed (ours), input_changed,
                     cache_salt_changed (ours), cache_expired (ours), cache_evicted (ours)
    none found       {"type": "unavailable"}

Every answer's fingerprint is kept (hashes only, service/cache_diagnosis.py), `store: false` ones too: no
text of the prompt is kept.
"""
from __future__ import annotations

from typing import Any

from aiohttp import web

from service.cache_diagnosis import FINGERPRINTS, Diagnosis, compare, fingerprint, live_leases, owner_of
from service.openai.generation import Generation
from service.openai.pipeline import Prepared
from service.openai.schema import ResponsesRequest

_REASONS = {"model": "model_changed", "tools": "tools_changed", "system": "instructions_changed",
            "message": "input_changed", "salt": "cache_salt_changed", "expired": "cache_expired",
            "evicted": "cache_evicted"}


def chat_options(body: ResponsesRequest) -> dict[str, Any] | None:
    """The prompt_cache_options the chat request takes (the comparison is this module's, after the answer)."""
    options = body.prompt_cache_options
    return None if options is None else options.model_dump(exclude_none=True, exclude={"comparison_response_id"})


def diagnostics(d: Diagnosis) -> dict[str, Any]:
    if d.reason == "not_found":
        return {"type": "comparison_response_not_found"}
    if d.reason == "hit":
        return {"type": "cache_hit"}
    if d.reason == "unavailable":
        return {"type": "unavailable"}
    return {"type": "cache_miss", "reason": _REASONS[d.reason], "cache_missed_tokens": d.missed,
            "comparison_reusable_tokens": d.reusable}


def finish(request: web.Request, prepared: Prepared, gen: Generation, body: ResponsesRequest, rid: str,
           conversation: list[dict[str, Any]], out: dict[str, Any]) -> None:
    """Completes a response (in place) with what its prompt-cache options ask for, and keeps its fingerprint.
    Call once its leases are taken (pipeline.leased)."""
    store, owner = request.app[FINGERPRINTS], owner_of(request)
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    cur = fingerprint(store, owner, prepared, tools, body.instructions, conversation)
    options = body.prompt_cache_options
    if options is not None and options.comparison_response_id is not None:
        prev = store.get(options.comparison_response_id, owner)
        out["prompt_cache_diagnostics"] = diagnostics(compare(prev, cur, gen.cached_tokens,
                                                              live_leases(prepared.ready.registry)))
    if prepared.req.prewarm:
        out.update(status="completed", output=[], incomplete_details=None)
    store.put(rid, cur)
