"""GET /openapi.json: OpenAPI 3.1, its request schemas generated from service/openai/schema.py's models.

The models are the one source of truth; this module only lays out the paths, narrows a few limits to
this server's values (n and best_of to `max_choices`, max_tokens to the context length, `model` to the
served name), and leaves out the fields the engine does not honour yet (they are refused with a 400).
"""
from __future__ import annotations

from typing import Any

from aiohttp import web
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from service.anthropic import schema as anthropic_schema
from service.openai import schema
from service.openai.params import UNSUPPORTED_FIELDS
from service.routes import worker_api
from service.state import STATE

_REF = "#/components/schemas/{model}"
_MODELS: list[type[BaseModel]] = [schema.CompletionRequest, schema.ChatCompletionRequest, schema.ResponsesRequest,
                                  schema.PrefixRequest, schema.PrefixPatch,
                                  schema.TokenizeCompletion, schema.TokenizeChat, schema.DetokenizeRequest,
                                  anthropic_schema.MessagesRequest, anthropic_schema.CountTokensRequest]

_ERROR = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "param", "code"], "properties": {
        "message": {"type": "string"}, "type": {"type": "string"},
        "param": {"type": ["string", "null"]}, "code": {"type": ["string", "null"]}}}}}


def _errors(*codes: int) -> dict[str, Any]:
    ref = {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}
    return {str(c): {"description": "error", "content": ref} for c in codes}


_ANTHROPIC_ERROR = {"type": "object", "required": ["type", "error"], "properties": {
    "type": {"const": "error"}, "error": {"type": "object", "required": ["type", "message"], "properties": {
        "type": {"type": "string"}, "message": {"type": "string"}}}}}


def _anthropic_errors(*codes: int) -> dict[str, Any]:
    ref = {"application/json": {"schema": {"$ref": "#/components/schemas/AnthropicError"}}}
    return {str(c): {"description": "error (Anthropic's shape)", "content": ref} for c in codes}


def _body(model: str | list[str]) -> dict[str, Any]:
    refs = [{"$ref": _REF.format(model=m)} for m in ([model] if isinstance(model, str) else model)]
    return {"required": True, "content": {"application/json": {"schema": refs[0] if len(refs) == 1
                                                                else {"anyOf": refs}}}}


def _answer(description: str, content_type: str = "application/json") -> dict[str, Any]:
    kind = "object" if content_type == "application/json" else "string"
    return {"description": description, "content": {content_type: {"schema": {"type": kind}}}}


def _generation(summary: str, model: str) -> dict[str, Any]:
    return {"post": {"summary": summary, "requestBody": _body(model), "responses": {
        "200": {"description": "the completion, or SSE chunks then `data: [DONE]` when stream is true",
                "content": {"application/json": {"schema": {"type": "object"}},
                            "text/event-stream": {"schema": {"type": "string"}}}},
        **_errors(400, 404, 413, 429, 503)}}}


def _get(summary: str, content_type: str = "application/json", *errors: int) -> dict[str, Any]:
    return {"get": {"summary": summary, "responses": {"200": _answer("ok", content_type), **_errors(*errors)}}}


def _narrow(schemas: dict[str, Any], model: str, max_choices: int, max_model_len: int | None) -> None:
    """This server's limits, in place, and no fields it refuses."""
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas[name]["properties"]
        for field in UNSUPPORTED_FIELDS:
            props.pop(field, None)
        if model:
            props["model"] = {"anyOf": [{"type": "string", "enum": [model]}, {"type": "null"}],
                              "description": "the served model name (GET /v1/models)"}
        for field in ("n", "best_of"):
            props[field]["anyOf"][0]["maximum"] = max_choices
        if max_model_len:
            for field in ("max_tokens", "max_completion_tokens"):
                if field in props:
                    props[field]["anyOf"][0]["maximum"] = max_model_len
    for name in ("MessagesRequest", "CountTokensRequest"):      # Anthropic's: `model` is required
        props = schemas[name]["properties"]
        if model:
            props["model"] = {"type": "string", "enum": [model], "description": "the served model name"}
        if max_model_len and "max_tokens" in props:
            props["max_tokens"]["maximum"] = max_model_len


def spec(model: str, max_choices: int, max_model_len: int | None, version: str = "0.1.0") -> dict[str, Any]:
    _, top = models_json_schema([(m, "validation") for m in _MODELS], ref_template=_REF)
    schemas = top["$defs"]
    _narrow(schemas, model, max_choices, max_model_len)
    schemas["Error"] = _ERROR
    schemas["AnthropicError"] = _ANTHROPIC_ERROR
    return {
        "openapi": "3.1.0",
        "info": {"title": "prefixserve", "version": version,
                 "description": "OpenAI-compatible LLM serving with shared, pinned prompt prefixes."},
        "paths": {
            "/v1/completions": _generation("Text completion", "CompletionRequest"),
            "/v1/chat/completions": _generation("Chat completion", "ChatCompletionRequest"),
            "/v1/responses": {"post": {
                "summary": "Responses API: a model response (text or tool calls), streamed as its events or whole",
                "requestBody": _body("ResponsesRequest"),
                "responses": {"200": _answer("the response, or its events (text/event-stream)"),
                              **_errors(400, 404, 408, 413, 429, 503)}}},
            "/v1/responses/{response_id}": {
                "parameters": [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "get": {"summary": "A stored response (only with the key that created it)",
                        "responses": {"200": _answer("the response"), **_errors(404, 503)}},
                "delete": {"summary": "Delete a stored response",
                           "responses": {"200": _answer("deleted"), **_errors(404, 503)}}},
            "/v1/messages": {"post": {
                "summary": "Anthropic's Messages API: a message (text or tool_use blocks), whole or as its events; "
                           "cache_control breakpoints held as leases (x-api-key or Authorization: Bearer)",
                "requestBody": _body("MessagesRequest"),
                "responses": {"200": {"description": "the message, or its events when stream is true",
                                      "content": {"application/json": {"schema": {"type": "object"}},
                                                  "text/event-stream": {"schema": {"type": "string"}}}},
                              **_anthropic_errors(400, 401, 404, 413, 429, 503)}}},
            "/v1/messages/count_tokens": {"post": {
                "summary": "The prompt tokens a Messages request would run ({\"input_tokens\"})",
                "requestBody": _body("CountTokensRequest"),
                "responses": {"200": _answer("the count"), **_anthropic_errors(400, 401, 404, 413, 503)}}},
            "/v1/models": _get("The served model", "application/json", 503),
            "/v1/models/{model}": {
                "parameters": [{"name": "model", "in": "path", "required": True, "schema": {"type": "string"}}],
                **_get("One model", "application/json", 404, 503)},
            "/v1/ws": {"get": {"summary": "WebSocket: multiplexed generate / cancel (see service/routes/websocket.py)",
                               "responses": {"101": {"description": "switching protocols"}, **_errors(400, 503)}}},
            "/tokenize": {"post": {"summary": "Token ids of a prompt, or of chat messages through the template",
                                   "requestBody": _body(["TokenizeCompletion", "TokenizeChat"]),
                                   "responses": {"200": _answer("the tokens"), **_errors(400, 404, 503)}}},
            "/detokenize": {"post": {"summary": "Text of token ids", "requestBody": _body("DetokenizeRequest"),
                                     "responses": {"200": _answer("the text"), **_errors(400, 404, 503)}}},
            "/version": _get("The server's version"),
            "/health": _get("200 when ready, 503 while warming or draining", "application/json", 503),
            "/metrics": _get("Prometheus metrics", "text/plain"),
            "/openapi.json": _get("This document"),
            "/": _get("The demo page", "text/html"),
            "/v1/prefixes": {
                "post": {"summary": "Register (and pin) a named prefix; 507 when the pinned-block cap is full",
                         "requestBody": _body("PrefixRequest"),
                         "responses": {"200": _answer("already registered with this content"),
                                       "201": _answer("registered and pinned"),
                                       **_errors(400, 401, 403, 409, 413, 503, 507)}},
                "get": {"summary": "The prefixes the caller may see, a page at a time (limit, after), with hits",
                        "parameters": [
                            {"name": "limit", "in": "query", "schema": {"type": "integer", "minimum": 1,
                                                                         "maximum": 1000}},
                            {"name": "after", "in": "query", "schema": {"type": "string"}}],
                        "responses": {"200": _answer("the list"), **_errors(400, 503)}}},
            "/v1/prefixes/{name}": {
                "parameters": [{"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}],
                "get": {"summary": "One registered prefix",
                        "responses": {"200": _answer("the prefix"), **_errors(403, 404, 503)}},
                "patch": {"summary": "Change a prefix's lease (ttl_seconds) or description",
                          "requestBody": _body("PrefixPatch"),
                          "responses": {"200": _answer("the prefix"), **_errors(400, 403, 404, 413, 503)}},
                "delete": {"summary": "Unregister (unpin) a prefix; its blocks become ordinary cached blocks",
                           "responses": {"200": _answer("deleted"), **_errors(403, 404, 503)}}},
            **_worker_paths(),
        },
        "components": {"schemas": schemas},
    }


def _worker_paths() -> dict[str, Any]:
    """service/routes/worker_api.py's routes (what a router asks of a worker), bodies as they are validated."""
    def post(summary: str, model: str | None) -> dict[str, Any]:
        body = {} if model is None else {"requestBody": _body(model)}
        responses = {"200": _answer("ok"), **_errors(400, 404, 413, 503)}
        return {"post": {"summary": summary, **body, "responses": responses}}

    bodies: dict[str, tuple[str, str | None]] = {
        "/v1/completions/render": ("Token ids a completion would run, named prefix included (vLLM's render)",
                                   "CompletionRequest"),
        "/v1/chat/completions/render": ("Token ids a chat completion would run (vLLM's render)",
                                        "ChatCompletionRequest"),
        "/flush_cache": ("Forget every evictable cached block (SGLang's name)", None),
        "/reset_prefix_cache": ("Forget every evictable cached block (vLLM's name)", None),
    }
    assert set(bodies) == set(worker_api.POSTS), "every worker route is documented"
    paths = {path: _get((handler.__doc__ or path).split("\n")[0], "application/json", 503)
             for path, handler in worker_api.GETS.items()}
    return {**paths, **{path: post(*bodies[path]) for path in worker_api.POSTS}}


async def handle(request: web.Request) -> web.Response:
    state = request.app[STATE]
    max_model_len = state.engine.max_model_len if state.engine is not None else None
    return web.json_response(spec(state.model_name, state.config.max_choices, max_model_len))
