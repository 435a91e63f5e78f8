"""Request validation: OpenAI JSON bodies into token ids and SamplingParams, or a 400 naming the field.

Types are checked strictly (a bool is not a number, a float is not an integer); ranges are checked by
SamplingParams itself, whose InvalidRequest becomes a 400 with the same `param`, except those that depend
on this server (n and best_of against max_choices) or on the API shape (logprobs: an int for completions,
a bool plus top_logprobs for chat).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from engine.errors import InvalidRequest
from engine.sequence import SamplingParams
from service.errors import ApiError, invalid

MAX_STOP = 16
MAX_LOGPROBS = 20


@dataclass
class GenerationRequest:
    """What a completions, chat or WebSocket request asks for, validated."""

    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    prefix: str | None = None
    user: str | None = None


async def read_json(request: web.Request) -> dict[str, Any]:
    """The body as a JSON object; 413 (client_max_size) surfaces as HTTPRequestEntityTooLarge."""
    raw = await request.read()
    return parse_json(raw)


def parse_json(raw: bytes | str) -> dict[str, Any]:
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise invalid(f"the body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise invalid("the body must be a JSON object")
    return body


def check_model(body: dict[str, Any], served: str) -> None:
    model = body.get("model")
    if model is None:
        return
    if not isinstance(model, str):
        raise invalid("model must be a string", "model")
    if model != served:
        raise ApiError(404, f"The model `{model}` does not exist. This server serves `{served}`.",
                       type="not_found_error", param="model", code="model_not_found")


def _typed(body: dict[str, Any], key: str, kind: str, default: Any = None) -> Any:
    value = body.get(key)
    if value is None:
        return default
    ok = {
        "int": isinstance(value, int) and not isinstance(value, bool),
        "number": isinstance(value, (int, float)) and not isinstance(value, bool)
        and math.isfinite(value),
        "bool": isinstance(value, bool),
        "str": isinstance(value, str),
    }[kind]
    if not ok:
        raise invalid(f"{key} must be {'a finite number' if kind == 'number' else 'a ' + kind}", key)
    return value


def parse_request(body: dict[str, Any], *, chat: bool, max_choices: int) -> GenerationRequest:
    max_tokens = _typed(body, "max_tokens", "int")
    if chat:
        max_tokens = _typed(body, "max_completion_tokens", "int", max_tokens)
    elif "max_tokens" not in body:
        max_tokens = 16                                    # the OpenAI completions default
    if max_tokens is not None and max_tokens < 1:
        raise invalid("max_tokens must be >= 1", "max_completion_tokens" if chat and
                      "max_completion_tokens" in body else "max_tokens")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is None:
        stop = []
    if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop) or len(stop) > MAX_STOP:
        raise invalid(f"stop must be a non-empty string or a list of at most {MAX_STOP} non-empty strings", "stop")
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise invalid("stop_token_ids must be a list of integers", "stop_token_ids")
    n = _typed(body, "n", "int", 1)
    if not 1 <= n <= max_choices:
        raise invalid(f"n must be within [1, {max_choices}]", "n")
    best_of = _typed(body, "best_of", "int")
    if best_of is not None and not n <= best_of <= max_choices:
        raise invalid(f"best_of must be within [n, {max_choices}] (n = {n})", "best_of")
    use_beam_search = _typed(body, "use_beam_search", "bool", False)
    early_stopping = body.get("early_stopping")
    if early_stopping is None:
        early_stopping = False
    if not (isinstance(early_stopping, bool) or early_stopping == "never"):
        raise invalid('early_stopping must be true, false or "never"', "early_stopping")
    logprobs = _logprobs(body, chat)
    if logprobs is not None and use_beam_search:
        raise invalid("logprobs are not reported for beam search", "logprobs")
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise invalid("stream_options must be an object", "stream_options")
    include_usage = _typed(options or {}, "include_usage", "bool", False)
    prefix = _typed(body, "prefix", "str")
    _typed(body, "user", "str")
    try:
        params = SamplingParams(
            n=n, temperature=float(_typed(body, "temperature", "number", 1.0)),
            top_p=float(_typed(body, "top_p", "number", 1.0)), top_k=_typed(body, "top_k", "int", -1),
            seed=_typed(body, "seed", "int"), max_tokens=max_tokens, stop=stop, stop_token_ids=stop_ids,
            ignore_eos=_typed(body, "ignore_eos", "bool", False), best_of=best_of, logprobs=logprobs,
            use_beam_search=use_beam_search, early_stopping=early_stopping,
            length_penalty=float(_typed(body, "length_penalty", "number", 1.0)))
    except InvalidRequest as exc:
        raise invalid(exc.message, exc.param) from None
    return GenerationRequest(params=params, stream=_typed(body, "stream", "bool", False), include_usage=include_usage,
                             return_token_ids=_typed(body, "return_token_ids", "bool", False), prefix=prefix,
                             user=body.get("user"))


def _logprobs(body: dict[str, Any], chat: bool) -> int | None:
    """The top-k asked for, or None. Completions: `logprobs` is that k (the legacy API). Chat:
    `logprobs: true` turns it on and `top_logprobs` (which needs it) is the k."""
    if not chat:
        k = _typed(body, "logprobs", "int")
        if k is not None and not 0 <= k <= MAX_LOGPROBS:
            raise invalid(f"logprobs must be within [0, {MAX_LOGPROBS}]", "logprobs")
        return k
    wanted = _typed(body, "logprobs", "bool", False)
    k = _typed(body, "top_logprobs", "int")
    if k is not None and not 0 <= k <= MAX_LOGPROBS:
        raise invalid(f"top_logprobs must be within [0, {MAX_LOGPROBS}]", "top_logprobs")
    if k is not None and not wanted:
        raise invalid("top_logprobs needs logprobs to be true", "top_logprobs")
    return (k or 0) if wanted else None


def check_choices(num_prompts: int, params: SamplingParams, max_choices: int) -> None:
    """Prompts x best_of (the sequences generated) is capped like prompts x n (those returned)."""
    best_of = params.best_of or params.n
    if num_prompts * best_of > max_choices:
        param = "best_of" if best_of > params.n else "n"
        raise invalid(f"the number of prompts times {param} must be at most {max_choices}", param)


def parse_prompts(body: dict[str, Any], tokenizer: Any) -> list[list[int]]:
    """`prompt` as a string, a list of strings, token ids, or a list of token-id lists: one entry each."""
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        return [encode_prompt(tokenizer, prompt)]
    if isinstance(prompt, list) and prompt:
        if all(_is_token(t) for t in prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return [encode_prompt(tokenizer, p) for p in prompt]
        if all(isinstance(p, list) and p and all(_is_token(t) for t in p) for p in prompt):
            return [list(p) for p in prompt]
    raise invalid("prompt must be a string, a list of strings, a non-empty list of token ids, "
                  "or a list of non-empty token-id lists", "prompt")


def parse_messages(messages: Any, tokenizer: Any) -> list[int]:
    """Chat messages through the model's chat template, ready for the assistant's answer."""
    return render_messages(clean_messages(messages), tokenizer, add_generation_prompt=True)


def clean_messages(messages: Any) -> list[dict[str, str]]:
    """Validated messages as {"role", "content"} with text content."""
    if not isinstance(messages, list) or not messages:
        raise invalid("messages must be a non-empty list", "messages")
    clean = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not m["role"]:
            raise invalid(f"messages[{i}] must be an object with a string role", "messages")
        clean.append({"role": m["role"], "content": _content(m.get("content"), i)})
    return clean


def render_messages(clean: list[dict[str, str]], tokenizer: Any, add_generation_prompt: bool) -> list[int]:
    """Token ids of the chat template's rendering; the template adds the special tokens."""
    try:
        text = tokenizer.apply_chat_template(clean, add_generation_prompt=add_generation_prompt, tokenize=False)
    except Exception as exc:  # a template that raises on this input (jinja's raise_exception, bad roles)
        raise invalid(f"the chat template rejected the messages: {exc}", "messages") from None
    return list(tokenizer.encode(text, add_special_tokens=False))


def _content(content: Any, i: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        if all(p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
            return "".join(p["text"] for p in content)
    raise invalid(f"messages[{i}].content must be a string or a list of text parts", "messages")


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    # NOTE: like vLLM, completions prompts get the tokenizer's own special tokens (e.g. Llama's BOS).
    return list(tokenizer.encode(text))


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)
