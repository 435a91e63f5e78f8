"""GET /openapi.json: OpenAPI 3.0 for every endpoint, precise enough for schemathesis to fuzz."""
from __future__ import annotations

from typing import Any

from aiohttp import web

from service.state import STATE

_INT = {"type": "integer"}
_TOKENS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {**schema, "nullable": True}


def _sampling(model: str, max_choices: int, max_model_len: int | None) -> dict[str, Any]:
    max_tokens = {"type": "integer", "minimum": 1, **({"maximum": max_model_len} if max_model_len else {})}
    return {
        "model": {"type": "string", **({"enum": [model]} if model else {}),
                  "description": "the served model name (GET /v1/models)"},
        "max_tokens": _nullable(max_tokens),
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 100}),
        "top_p": _nullable({"type": "number", "exclusiveMinimum": True, "minimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": -1}),
        "n": _nullable({"type": "integer", "minimum": 1, "maximum": max_choices}),
        "stop": _nullable({"oneOf": [{"type": "string", "minLength": 1}, {
            "type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": 16}]}),
        "stop_token_ids": _nullable({"type": "array", "items": {"type": "integer", "minimum": 0}}),
        "seed": _nullable(_INT),
        "stream": _nullable({"type": "boolean"}),
        "stream_options": _nullable({"type": "object", "properties": {"include_usage": {"type": "boolean"}}}),
        "ignore_eos": _nullable({"type": "boolean"}),
        "user": _nullable({"type": "string"}),
        "prefix": _nullable({"type": "string", "description": "name of a registered prefix to put first"}),
        "return_token_ids": _nullable({"type": "boolean", "description": "add token ids to each choice"}),
        "best_of": _nullable({"type": "integer", "minimum": 1, "maximum": max_choices,
                              "description": "sequences generated per prompt (>= n); the n best are returned"}),
        "use_beam_search": _nullable({"type": "boolean", "description": "beam search, best_of beams wide"}),
        "length_penalty": _nullable({"type": "number", "minimum": -10, "maximum": 10}),
        "early_stopping": _nullable({"oneOf": [{"type": "boolean"}, {"type": "string", "enum": ["never"]}]}),
    }


_TOP_K = {"type": "integer", "minimum": 0, "maximum": 20}

_MESSAGE = {"type": "object", "required": ["role"], "properties": {
    "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
    "content": _nullable({"oneOf": [{"type": "string"}, {"type": "array", "items": {
        "type": "object", "required": ["type", "text"],
        "properties": {"type": {"type": "string", "enum": ["text"]}, "text": {"type": "string"}}}}]})}}

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": _nullable({"type": "string"}), "code": _nullable({"type": "string"})}}}}


def _errors(*codes: int) -> dict[str, Any]:
    ref = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    return {str(c): {"description": "error", "content": ref} for c in codes}


def _generation(summary: str, request_ref: str) -> dict[str, Any]:
    return {"post": {
        "summary": summary,
        "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{request_ref}"}}}},
        "responses": {
            "200": {"description": "the completion, or SSE chunks then `data: [DONE]` when stream is true",
                    "content": {"application/json": {"schema": {"type": "object"}},
                                "text/event-stream": {"schema": {"type": "string"}}}},
            **_errors(400, 404, 413, 429, 503)}}}


def _prefix_request(source: str, schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "required": ["name", source], "additionalProperties": False, "properties": {
        "name": {"type": "string", "pattern": "^[A-Za-z0-9._-]{1,64}$"}, source: schema,
        "description": _nullable({"type": "string"})}}


def _answer(description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {"type": "object"}}}}


def _get(summary: str, content_type: str = "application/json", *errors: int) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {
        "200": {"description": "ok", "content": {content_type: {"schema": {
            "type": "string" if content_type != "application/json" else "object"}}}},
        **_errors(*errors)}}}


def spec(model: str, max_choices: int, max_model_len: int | None, version: str = "0.1.0") -> dict[str, Any]:
    """`model`, `max_choices` and `max_model_len` narrow the request schemas to what this server accepts."""
    sampling = _sampling(model, max_choices, max_model_len)
    text = {"type": "string", "minLength": 1}    # an empty prompt has no token to start from
    prompt = {"oneOf": [text, {"type": "array", "items": text, "minItems": 1},
                        _TOKENS, {"type": "array", "items": _TOKENS, "minItems": 1}]}
    return {
        "openapi": "3.0.3",
        "info": {"title": "prefixserve", "version": version,
                 "description": "OpenAI-compatible LLM serving with shared, pinned prompt prefixes."},
        "paths": {
            "/v1/completions": _generation("Text completion", "CompletionRequest"),
            "/v1/chat/completions": _generation("Chat completion", "ChatCompletionRequest"),
            "/v1/models": _get("The served model", "application/json", 503),
            "/v1/ws": {"get": {"summary": "WebSocket: multiplexed generate / cancel (see service/websocket.py)",
                               "responses": {"101": {"description": "switching protocols"}, **_errors(400, 503)}}},
            "/health": _get("200 when ready, 503 while warming or draining", "application/json", 503),
            "/metrics": _get("Prometheus metrics", "text/plain"),
            "/openapi.json": _get("This document"),
            "/": _get("The demo page", "text/html"),
            "/v1/prefixes": {
                "post": {"summary": "Register (and pin) a named prefix; 507 when the pinned-block cap is full",
                         "requestBody": {"required": True, "content": {"application/json": {
                             "schema": {"$ref": "#/components/schemas/PrefixRequest"}}}},
                         "responses": {"200": _answer("already registered with this content"),
                                       "201": _answer("registered and pinned"),
                                       **_errors(400, 409, 413, 503, 507)}},
                "get": {"summary": "Registered prefixes, with hits and tokens saved",
                        "responses": {"200": _answer("the list"), **_errors(503)}}},
            "/v1/prefixes/{name}": {
                "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
                "get": {"summary": "One registered prefix",
                        "responses": {"200": _answer("the prefix"), **_errors(404, 503)}},
                "delete": {"summary": "Unregister (unpin) a prefix; its blocks become ordinary cached blocks",
                           "responses": {"200": _answer("deleted"), **_errors(404, 503)}}},
        },
        "components": {"schemas": {
            "CompletionRequest": {"type": "object", "required": ["prompt"], "properties": {
                "prompt": prompt, **sampling,
                "logprobs": _nullable({**_TOP_K, "description": "top-k log-probabilities per token"})}},
            "ChatCompletionRequest": {"type": "object", "required": ["messages"], "properties": {
                "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
                "max_completion_tokens": sampling["max_tokens"], **sampling,
                "logprobs": _nullable({"type": "boolean"}),
                "top_logprobs": _nullable({**_TOP_K, "description": "needs logprobs: true"})}},
            "PrefixRequest": {"oneOf": [_prefix_request("prompt", text), _prefix_request("messages", {
                "type": "array", "items": _MESSAGE, "minItems": 1})],
                "description": "exactly one of prompt (tokenized as completions do) or messages (through the "
                               "chat template, no generation prompt)"},
            "Error": _ERROR,
        }},
    }


async def handle(request: web.Request) -> web.Response:
    state = request.app[STATE]
    max_model_len = state.engine.max_model_len if state.engine is not None else None
    return web.json_response(spec(state.model_name, state.config.max_choices, max_model_len))
