"""A validated request's meaning: what a completions, chat or WebSocket body asks of the engine.

    parse(raw, chat, served, max_choices) -> Parsed     the body through its schema model (schema.py),
                                                        then to_generation: SamplingParams + options

Types and ranges are the schema's (whose numeric ranges are the engine's own table); this module adds
the rules that span fields or depend on this server (n and best_of against max_choices, max_tokens 0
only with echo or prompt_cache_key (a prefill that only writes the cache), logprobs against beam search,
tool choice), and refuses the fields the engine cannot honour yet with a 400 naming them.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequest
from engine.sample.structured import StructuredSpec
from engine.sequence import SamplingParams
from service.errors import ApiError, invalid
from service.openai.schema import ChatCompletionRequest, CompletionRequest, NamedToolChoice, _PromptCache, parse_model
from service.openai.tools import ToolPlan, named_schema, required_schema


@dataclass
class GenerationRequest:
    """What a completions, chat or WebSocket request asks for, validated."""

    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    continuous_usage: bool = False  # stream_options.continuous_usage_stats: usage so far on every chunk
    return_token_ids: bool = False
    prefix: str | None = None
    user: str | None = None
    echo: bool = False              # completions: the prompt goes before each choice's text (and logprobs)
    tools: ToolPlan | None = None   # chat: how the answer calls tools (service/openai/tools.py)
    cache_salt: str | None = None   # the client's, narrowing its tenant's cache (service/tenants.py)
    cache_key: str | None = None    # prompt_cache_key: lease the common prefix of its prompts
    cache_ttl: float | None = None  # the lease's length asked for (retention / options.ttl), None: the default
    prewarm: bool = False           # prompt_cache_options.prewarm: only write the prompt into the cache


@dataclass
class Parsed:
    body: CompletionRequest | ChatCompletionRequest
    req: GenerationRequest
    ignored: list[str] = field(default_factory=list)    # fields the schema does not know, dropped (schema.py)

    @property
    def num_prompts(self) -> int:
        """Prompts the body holds, known before tokenizing: a chat request is one."""
        body = self.body
        if isinstance(body, ChatCompletionRequest) or isinstance(body.prompt, str):
            return 1
        return 1 if all(isinstance(t, int) for t in body.prompt) else len(body.prompt)


def parse(raw: bytes | dict[str, Any], chat: bool, served: str, max_choices: int,
          strict_fields: bool = False) -> Parsed:
    """The body validated as a chat or completion request, for the model this server serves. Raises a 4xx.
    Unknown fields are dropped and listed in `Parsed.ignored` (refused with `strict_fields`)."""
    ignored: list[str] = []
    body = parse_model(ChatCompletionRequest if chat else CompletionRequest, raw, strict_fields, ignored)
    check_model(body.model, served)
    return Parsed(body, to_generation(body, max_choices=max_choices), ignored)


def check_model(model: str | None, served: str) -> None:
    if model is not None and model != served:
        raise ApiError(404, f"The model `{model}` does not exist. This server serves `{served}`.",
                       type="not_found_error", param="model", code="model_not_found")


# Fields of the schema that the engine does not honour (yet): refused with a 400 when set to anything
# but their neutral value, never silently ignored; /openapi.json leaves them out.
UNSUPPORTED_FIELDS = {
    "suffix": "suffix (insertion) is not supported",
}
_NEUTRAL: dict[str, Any] = {"suffix": ""}


def _unsupported(req: CompletionRequest | ChatCompletionRequest) -> list[tuple[str, str]]:
    out = []
    for name, message in UNSUPPORTED_FIELDS.items():
        value = getattr(req, name, None)
        if value is not None and value != _NEUTRAL.get(name, object()):
            out.append((name, message))
    return out


def _structured(req: CompletionRequest | ChatCompletionRequest) -> StructuredSpec | None:
    """The output constraint a request asks for (response_format, or vLLM's guided_* on completions)."""
    specs: list[StructuredSpec] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        specs.append(StructuredSpec("json", param="response_format"))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise invalid("response_format json_schema needs a json_schema with a schema", "response_format")
        specs.append(StructuredSpec("json_schema", json.dumps(fmt.json_schema.schema_), "response_format"))
    so = req.structured_outputs
    if so is not None:
        if so.grammar is not None:
            raise invalid("structured_outputs.grammar is not supported: use json, regex or choice",
                          "structured_outputs")
        specs += _constraints(so.json_, so.regex, so.choice, ("structured_outputs",) * 3)
        if so.json_object:
            specs.append(StructuredSpec("json", param="structured_outputs"))
    if isinstance(req, CompletionRequest):
        specs += _constraints(req.guided_json, req.guided_regex, req.guided_choice,
                              ("guided_json", "guided_regex", "guided_choice"))
    if len(specs) > 1:
        raise invalid("give at most one output constraint (response_format, structured_outputs, guided_json, "
                      "guided_regex, guided_choice)", specs[1].param)
    return specs[0] if specs else None


def _constraints(schema: dict[str, Any] | str | None, regex: str | None, choice: list[str] | None,
                 params: tuple[str, str, str]) -> list[StructuredSpec]:
    """vLLM's json / regex / choice constraints (guided_* or structured_outputs), each named by its param."""
    specs = []
    if schema is not None:
        specs.append(StructuredSpec("json_schema", schema if isinstance(schema, str) else json.dumps(schema),
                                    params[0]))
    if regex is not None:
        specs.append(StructuredSpec("regex", regex, params[1]))
    if choice is not None:
        specs.append(StructuredSpec.choice(list(choice), params[2]))
    return specs


def _tool_plan(req: ChatCompletionRequest) -> ToolPlan | None:
    choice = req.tool_choice
    if not req.tools:
        if choice not in (None, "none"):
            raise invalid("tool_choice needs tools", "tool_choice")
        return None
    if choice == "none":
        return None
    parallel = req.parallel_tool_calls is not False
    if isinstance(choice, NamedToolChoice):
        named = next((t for t in req.tools if t.function.name == choice.function.name), None)
        if named is None:
            raise invalid(f"tool_choice names {choice.function.name!r}, which is not among the tools", "tool_choice")
        return ToolPlan("named", list(req.tools), named, parallel)
    return ToolPlan("required" if choice == "required" else "auto", list(req.tools), None, parallel)


def to_generation(req: CompletionRequest | ChatCompletionRequest, *, max_choices: int) -> GenerationRequest:
    """The engine's SamplingParams and the response options of a validated request. Raises a 400."""
    refused = _unsupported(req)
    if refused:
        raise invalid(refused[0][1], refused[0][0])
    max_tokens = req.max_tokens
    echo = isinstance(req, CompletionRequest) and bool(req.echo)
    if isinstance(req, ChatCompletionRequest) and req.continue_final_message:
        if req.add_generation_prompt:
            raise invalid("continue_final_message and add_generation_prompt cannot both be true",
                          "continue_final_message")
        if req.messages[-1].role != "assistant":
            raise invalid("continue_final_message needs the last message to be the assistant's", "messages")
    param = "max_tokens"
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens, param = req.max_completion_tokens, "max_completion_tokens"
    prewarm = bool(req.prompt_cache_options and req.prompt_cache_options.prewarm)
    if prewarm:
        max_tokens = 0
    if max_tokens == 0 and not echo and req.prompt_cache_key is None and not prewarm:
        raise invalid(f"{param} must be >= 1 (0 is for scoring a prompt with echo, or for writing it into the "
                      "cache with prompt_cache_key or prompt_cache_options.prewarm)", param)
    n = req.n or 1
    if n > max_choices:
        raise invalid(f"n must be within [1, {max_choices}]", "n")
    if req.best_of is not None and not n <= req.best_of <= max_choices:
        raise invalid(f"best_of must be within [n, {max_choices}] (n = {n})", "best_of")
    logprobs = _logprobs(req)
    if logprobs is not None and req.use_beam_search:
        raise invalid("logprobs are not reported for beam search", "logprobs")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    structured = _structured(req)
    plan = _tool_plan(req) if isinstance(req, ChatCompletionRequest) else None
    if plan is not None and plan.mode in ("named", "required"):
        if structured is not None:
            raise invalid("tool_choice forces a tool call; it cannot be combined with response_format",
                          "response_format")
        schema = named_schema(plan.named) if plan.named is not None else required_schema(plan.tools, plan.parallel)
        structured = StructuredSpec("json_schema", json.dumps(schema), "tools")
    try:
        params = SamplingParams(
            n=n, best_of=req.best_of, temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p, top_k=-1 if req.top_k is None else req.top_k,
            seed=req.seed, max_tokens=max_tokens, stop=stop, stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=bool(req.ignore_eos), logprobs=logprobs, use_beam_search=bool(req.use_beam_search),
            prompt_logprobs=logprobs if echo else None,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias={int(k): v for k, v in req.logit_bias.items()} if req.logit_bias else None,
            min_tokens=req.min_tokens or 0, min_p=req.min_p or 0.0, structured=structured,
            early_stopping=False if req.early_stopping is None else req.early_stopping,
            length_penalty=1.0 if req.length_penalty is None else req.length_penalty,
            skip_special_tokens=req.skip_special_tokens is not False,
            include_stop_str_in_output=bool(req.include_stop_str_in_output or req.no_stop_trim))
    except InvalidRequest as exc:
        raise invalid(exc.message, exc.param) from None
    options = req.stream_options
    return GenerationRequest(params=params, stream=bool(req.stream),
                             include_usage=bool(options and options.include_usage),
                             continuous_usage=bool(options and options.continuous_usage_stats),
                             return_token_ids=bool(req.return_token_ids), prefix=req.prefix, user=req.user,
                             echo=echo, tools=plan, cache_salt=req.cache_salt, cache_key=req.prompt_cache_key,
                             cache_ttl=cache_ttl(req), prewarm=prewarm)


_TTL_UNITS = {"s": 1, "m": 60, "h": 3600}


def cache_ttl(req: _PromptCache) -> float | None:
    """The lease a request asks for: the longer of prompt_cache_retention (24h) and prompt_cache_options.ttl;
    None for the server's default (in_memory)."""
    asked = [86400.0] if req.prompt_cache_retention == "24h" else []
    ttl = req.prompt_cache_options.ttl if req.prompt_cache_options is not None else None
    if ttl is not None:
        asked.append(float(int(ttl[:-1]) * _TTL_UNITS[ttl[-1]]))
    return max(asked) if asked else None


def _logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """The top-k asked for, or None. Completions: `logprobs` is that k (the legacy API). Chat:
    `logprobs: true` turns it on and `top_logprobs` (which needs it) is the k."""
    if isinstance(req, CompletionRequest):
        return req.logprobs
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("top_logprobs needs logprobs to be true", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None
