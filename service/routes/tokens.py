"""POST /tokenize and POST /detokenize, in vLLM's shapes.

/tokenize takes a completion-style `prompt` (special tokens added unless `add_special_tokens` is false)
or chat `messages` (through the chat template, with the generation prompt unless told otherwise) and
answers {"count", "max_model_len", "tokens"[, "token_strs"]}. /detokenize takes {"tokens"} and answers
{"prompt"}. Both run on a tokenizer thread, like every request's tokenization (a large body on the large
bodies' thread, service/tokenizer_threads.py), answer serialized there too; the text to tokenize is
capped by --max-prompt-chars (400) before any tokenizing.
"""
from __future__ import annotations

import json
from typing import Any

from aiohttp import web

from service.errors import invalid
from service.openai.params import check_model
from service.openai.pipeline import check_prompt_chars, read_body
from service.openai.render import render_messages, template_messages
from service.openai.schema import DetokenizeRequest, TokenizeChat, TokenizeCompletion, parse_model, parse_object
from service.state import STATE


def _tokenize(raw: bytes, tokenizer: Any, served: str, max_model_len: int, max_chars: int) -> bytes:
    obj = parse_object(raw)
    body = parse_model(TokenizeChat if "messages" in obj else TokenizeCompletion, obj, strict_fields=True)
    check_model(body.model, served)
    if isinstance(body, TokenizeChat):
        check_prompt_chars([m.text() for m in body.messages], "messages", max_chars)
    else:
        check_prompt_chars([body.prompt], "prompt", max_chars)
    if isinstance(body, TokenizeChat):
        tools = [t.model_dump() for t in body.tools] if body.tools else None
        if body.continue_final_message and body.add_generation_prompt:
            raise invalid("continue_final_message and add_generation_prompt cannot both be true",
                          "continue_final_message")
        ids = render_messages(template_messages(body.messages), tokenizer, body.add_generation_prompt, tools,
                              body.continue_final_message)
        if body.add_special_tokens:      # what the tokenizer puts around any text (e.g. a BOS), added once
            ids = list(tokenizer.encode("", add_special_tokens=True)) + ids
    else:
        ids = list(tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens))
    out: dict[str, Any] = {"count": len(ids), "max_model_len": max_model_len, "tokens": ids,
                           "token_strs": tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None}
    return json.dumps(out).encode()       # serialized here too: a million ids take ~0.1 s, not the loop's


def _detokenize(raw: bytes, tokenizer: Any, served: str, vocab_size: int) -> bytes:
    body = parse_model(DetokenizeRequest, raw, strict_fields=True)
    check_model(body.model, served)
    if any(t >= vocab_size for t in body.tokens):
        raise invalid(f"token ids must be in [0, {vocab_size})", "tokens")
    return json.dumps({"prompt": tokenizer.decode(body.tokens)}).encode()


async def tokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.ready_engine()
    raw = await read_body(request, state.config.body_timeout)
    out = await state.tokenizers.run(len(raw), engine.tokenizer, lambda tok: _tokenize(
        raw, tok, state.model_name, engine.max_model_len, state.config.max_prompt_chars))
    return web.Response(body=out, content_type="application/json")


async def detokenize(request: web.Request) -> web.Response:
    state = request.app[STATE]
    engine = state.ready_engine()
    raw = await read_body(request, state.config.body_timeout)
    out = await state.tokenizers.run(len(raw), engine.tokenizer, lambda tok: _detokenize(
        raw, tok, state.model_name, engine.vocab_size))
    return web.Response(body=out, content_type="application/json")


def setup(app: web.Application) -> None:
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)
