"""The request schema: typed pydantic models for every JSON body the service accepts.

One source of truth: validation (strict types, ranges) and /openapi.json (service/routes/openapi.py) both come from
these models. A known field is honoured, accepted as having no effect here (listed in NO_EFFECT, typed all the
same: a wrong value is a 400 naming it), or refused with a 400 that names it and says why. A field nobody
declared (anywhere in the body: top level, messages, stream_options...) is accepted and ignored, and named
in a warning (`parse_model` collects them: the pipeline logs them and sends them back in the
`X-Ignored-Fields` header), as vLLM does; `--strict-fields` refuses them with a 400 instead. That is the
generation endpoints' policy (chat, completions, the WebSocket); our own APIs (prefixes, tokenize) refuse
unknown fields always.

Extensions beyond the OpenAI API (vLLM's names where vLLM has the field):
  prefix                     name of a registered prefix to put before the prompt (ours)
  cache_salt                 narrows the prefix cache within the caller's tenant (vLLM's; service/tenants.py)
  top_k, min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos,
  best_of (chat too), use_beam_search, length_penalty, early_stopping, return_token_ids,
  guided_json, guided_regex, guided_choice (completions), skip_special_tokens,
  include_stop_str_in_output, add_generation_prompt and continue_final_message (chat)  (vLLM's)
  no_stop_trim (= include_stop_str_in_output), return_hidden_states (false only),
  separate_reasoning, stream_reasoning, include_reasoning (true only)                   (SGLang's)

OpenAI's prompt caching fields are honoured: prompt_cache_key (a lease on the common prefix of the prompts that
send it, within the caller's tenant), prompt_cache_retention and prompt_cache_options.ttl (its length); usage
reports cached_tokens and cache_write_tokens (service/openai/pipeline.py, prefix_store/registry.py).

Fields of the OpenAI SDK's request types, other servers' and clients that have no effect here (NO_EFFECT):
  store, metadata, service_tier, reasoning_effort, verbosity, safety_identifier, prediction,
  prompt_cache_options.mode, stream_options.include_obfuscation,
  priority (vLLM's), cache_prompt (llama.cpp's); in messages clients echo back: refusal, annotations, audio,
  reasoning_content / reasoning, provider_specific_fields (litellm's). `modalities` takes ["text"] only,
  `audio` and a message's `function_call` null only, chat `echo` false only (vLLM's).
Honoured beyond the above: stream_options.continuous_usage_stats (usage on every chunk), chat_template_kwargs
(extra variables for the chat template, vLLM's), structured_outputs (vLLM's: json, regex, choice, json_object).

SGLang's fields are those vllm-router writes into every request it forwards, at their defaults. The
three reasoning fields only matter to a server with a reasoning parser; this one has none, so the
model's text is never split into reasoning and content (what SGLang does without a parser), and
include_reasoning=false (drop the reasoning) is refused.

Numeric ranges come from the engine's one table (engine/sequence.py SAMPLING_RANGES). Server-dependent
limits (n and best_of against `max_choices`, max_tokens against the context length) are checked by the
request pipeline (service/openai/pipeline.py); the OpenAPI document narrows the schemas to this server's values.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from engine.sequence import SAMPLING_RANGES
from prefix_store.access import NAME_PATTERN
from service.errors import ApiError, invalid

MAX_STOP = 16                # stop strings per request
MAX_STOP_LEN = 256           # characters per stop string
MAX_STOP_TOKEN_IDS = 256
MAX_LOGIT_BIAS = 1024        # entries
MAX_MESSAGES = 2048
MAX_TOOLS = 128
MAX_PROMPTS = 1024           # prompts in one completions request (also capped by max_choices)

def bounds(name: str) -> Any:
    """The Field constraint of the engine's range for `name` (engine/sequence.py SAMPLING_RANGES: one table
    for the schema, /openapi.json and SamplingParams)."""
    r = SAMPLING_RANGES[name]
    limits: dict[str, float] = {}
    if r.lo is not None:
        limits["gt" if r.open_lo else "ge"] = r.lo
    if r.hi is not None:
        limits["le"] = r.hi
    return Field(**limits)  # type: ignore[call-overload]


TokenId = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
StopStr = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LEN)]


class _Strict(BaseModel):
    """Strict types (no "5" for 5, no 1 for true); unknown fields kept aside for `parse_model` to name."""

    model_config = ConfigDict(strict=True, extra="allow")


# Known fields accepted without effect on this server (the module docstring says why each).
NO_EFFECT = ("store", "metadata", "service_tier", "reasoning_effort", "verbosity", "safety_identifier", "prediction",
             "mode", "priority", "cache_prompt", "include_obfuscation",
             "refusal", "annotations", "audio", "reasoning_content", "reasoning", "provider_specific_fields")
MAX_METADATA = 16            # OpenAI's limit: 16 pairs, keys of 64 characters, values of 512
MetadataKey = Annotated[str, Field(max_length=64)]
MetadataValue = Annotated[str, Field(max_length=512)]


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False                # vLLM's: usage (so far) on every chunk
    include_obfuscation: bool | None = None             # no effect


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: NonEmptyStr
    arguments: str


class ToolCall(_Strict):
    id: NonEmptyStr
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None           # an assistant turn that called tools
    tool_call_id: str | None = None                    # a tool turn: the call it answers
    # what clients echo back from an answer (message.model_dump(), litellm's objects): no effect here
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    function_call: None = None                         # the deprecated functions API: null only
    reasoning_content: str | None = None
    reasoning: str | None = None
    provider_specific_fields: dict[str, Any] | None = None

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        return "".join(p.text for p in self.content)


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: NonEmptyStr


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64)]
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's structured_outputs: one of json (a schema), regex, choice, json_object (grammar is refused)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    json_object: bool | None = None
    grammar: str | None = None

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)


MAX_CACHE_KEY = 1024          # prompt_cache_key and cache_salt: characters
CacheKey = Annotated[str, Field(min_length=1, max_length=MAX_CACHE_KEY)]
PrefixName = Annotated[str, Field(pattern=NAME_PATTERN)]    # a registered prefix's name (prefix_store/access.py)
CacheTtl = Annotated[str, Field(pattern=r"^[1-9][0-9]{0,6}[smh]$")]     # "30m" (the SDK's), "24h", "90s"


class PromptCacheOptions(_Strict):
    mode: Literal["implicit", "explicit"] | None = None                 # no effect: every prompt is cached
    ttl: CacheTtl | None = None
    prewarm: bool | None = None     # only write the prompt into the cache (max_tokens 0), held as a lease


class ResponsesPromptCacheOptions(PromptCacheOptions):
    comparison_response_id: NonEmptyStr | None = None   # diagnose a miss against that response (prompt_cache.py)


class _PromptCache(_Strict):
    """The prompt caching fields (the module docstring)."""

    prompt_cache_key: CacheKey | None = None
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    prompt_cache_options: PromptCacheOptions | None = None
    cache_salt: CacheKey | None = None


class _Sampling(_PromptCache):
    """Fields shared by completions and chat."""

    model: str | None = None
    temperature: Annotated[float, bounds("temperature")] | None = None
    top_p: Annotated[float, bounds("top_p")] | None = None
    top_k: Annotated[int, bounds("top_k")] | None = None
    min_p: Annotated[float, bounds("min_p")] | None = None
    n: Annotated[int, bounds("n")] | None = None
    best_of: Annotated[int, bounds("best_of")] | None = None
    seed: Annotated[int, bounds("seed")] | None = None
    stop: StopStr | Annotated[list[StopStr], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    presence_penalty: Annotated[float, bounds("presence_penalty")] | None = None
    frequency_penalty: Annotated[float, bounds("frequency_penalty")] | None = None
    repetition_penalty: Annotated[float, bounds("repetition_penalty")] | None = None
    logit_bias: Annotated[dict[str, Annotated[float, bounds("logit_bias")]],
                          Field(max_length=MAX_LOGIT_BIAS)] | None = None
    min_tokens: Annotated[int, bounds("min_tokens")] | None = None
    ignore_eos: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    prefix: PrefixName | None = None
    return_token_ids: bool | None = None
    use_beam_search: bool | None = None
    length_penalty: Annotated[float, bounds("length_penalty")] | None = None
    early_stopping: bool | Literal["never"] | None = None
    response_format: ResponseFormat | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    no_stop_trim: bool | None = None
    return_hidden_states: Literal[False] | None = None
    separate_reasoning: bool | None = None
    stream_reasoning: bool | None = None
    include_reasoning: Literal[True] | None = None
    structured_outputs: StructuredOutputs | None = None
    # accepted, no effect here (NO_EFFECT)
    store: bool | None = None
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=MAX_METADATA)] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    safety_identifier: str | None = None
    priority: int | None = None
    cache_prompt: bool | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is not None:
            for key in v:
                # ASCII digits only ("²" and other Unicode digits pass isdigit() but are no token id), and short
                # enough to be one (a 5,000-digit key is not)
                if not (key.isascii() and key.isdigit() and len(key) <= 10):
                    raise ValueError(f"logit_bias keys must be token ids (decimal strings), got {key[:20]!r}")
        return v


class CompletionRequest(_Sampling):
    prompt: (Annotated[str, Field(min_length=1)] | Annotated[list[NonEmptyStr], Field(min_length=1)]
             | TokenIds | Annotated[list[TokenIds], Field(min_length=1)])
    max_tokens: Annotated[int, bounds("max_tokens")] | None = 16   # 0 only with echo (service/openai/params.py)
    logprobs: Annotated[int, bounds("logprobs")] | None = None
    echo: bool | None = None
    suffix: str | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None


class ChatCompletionRequest(_Sampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: Annotated[int, bounds("max_tokens")] | None = None
    max_completion_tokens: Annotated[int, bounds("max_tokens")] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, bounds("logprobs")] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    add_generation_prompt: bool | None = None     # default true: the template opens the assistant's turn
    continue_final_message: bool | None = None    # the last (assistant) message left open, to be continued
    chat_template_kwargs: dict[str, Any] | None = None   # vLLM's: more variables for the chat template
    modalities: list[Literal["text"]] | None = None      # text is what this server answers
    audio: None = None                                   # no audio output: null only
    echo: Literal[False] | None = None                   # vLLM's chat echo: not supported, false only
    # accepted, no effect here (NO_EFFECT)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    prediction: dict[str, Any] | None = None


# The Responses API's request (service/openai/responses/api.py translates it into a chat request).
MAX_INPUT_ITEMS = 2048


class ResponseFunctionTool(_Strict):
    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseFunctionChoice(_Strict):
    type: Literal["function"]
    name: NonEmptyStr


class ResponseTextFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)


class ResponseTextConfig(_Strict):
    format: ResponseTextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None       # no effect


class ResponsesRequest(_PromptCache):
    prompt_cache_options: ResponsesPromptCacheOptions | None = None
    model: str | None = None
    input: str | Annotated[list[dict[str, Any]], Field(max_length=MAX_INPUT_ITEMS)]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: Annotated[list[ResponseFunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | ResponseFunctionChoice | None = None
    parallel_tool_calls: bool | None = None
    temperature: Annotated[float, bounds("temperature")] | None = None
    top_p: Annotated[float, bounds("top_p")] | None = None
    max_output_tokens: Annotated[int, bounds("max_tokens")] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    store: bool | None = None
    text: ResponseTextConfig | None = None
    seed: Annotated[int, bounds("seed")] | None = None              # vLLM's extension, as on chat
    prefix: PrefixName | None = None                                 # ours: a named prefix first
    background: Literal[False] | None = None                         # no background mode here
    # accepted, no effect here (service/openai/schema.py NO_EFFECT)
    metadata: Annotated[dict[MetadataKey, MetadataValue], Field(max_length=MAX_METADATA)] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None
    max_tool_calls: Annotated[int, Field(ge=1)] | None = None


MAX_DESCRIPTION = 4096


class PrefixRequest(_Strict):
    """Exactly one of `prompt` (tokenized as completions do) or `messages` (through the chat template,
    no generation prompt)."""

    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    prompt: Annotated[str, Field(min_length=1)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    description: Annotated[str, Field(max_length=MAX_DESCRIPTION)] | None = None
    published: bool | None = None               # admins: for every tenant (their default); users: false only
    ttl_seconds: Annotated[float, Field(gt=0)] | None = None     # a lease (at most --max-lease-seconds)


class PrefixPatch(_Strict):
    """PATCH /v1/prefixes/{name}: a field given is changed (ttl_seconds null ends the lease: kept until deleted)."""

    ttl_seconds: Annotated[float, Field(gt=0)] | None = None
    description: Annotated[str, Field(max_length=MAX_DESCRIPTION)] | None = None


class TokenizeCompletion(_Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(_Strict):
    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    add_generation_prompt: bool = True
    continue_final_message: bool = False    # the last message left open (vLLM's field)
    add_special_tokens: bool = False
    return_token_strs: bool = False
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None


class DetokenizeRequest(_Strict):
    model: str | None = None
    tokens: list[TokenId]


MAX_IGNORED = 16             # unknown fields named in a warning (the rest counted)


def parse_model(model: type[_Strict], raw: bytes | str | dict[str, Any], strict_fields: bool = False,
                ignored: list[str] | None = None) -> Any:
    """`raw` (JSON bytes or text, or an already parsed object) as `model`; a 400 naming the field otherwise.
    Fields the schema does not declare are dropped and their paths appended to `ignored` (at most
    MAX_IGNORED of them); with `strict_fields` the first is refused with a 400 instead."""
    try:
        body = model.model_validate(raw) if isinstance(raw, dict) else model.model_validate_json(raw)
    except ValidationError as exc:
        raise _schema_error(exc) from None
    found = _unknown(body, "")
    if found and strict_fields:
        raise invalid(f"unknown field {found[0]!r}: this server does not accept it (see /openapi.json)",
                      found[0].split(".")[0].split("[")[0])
    if ignored is not None:
        ignored += found[:MAX_IGNORED]
        if len(found) > MAX_IGNORED:
            ignored.append(f"(and {len(found) - MAX_IGNORED} more)")
    return body


def _unknown(node: Any, path: str) -> list[str]:
    """The dotted paths of undeclared fields under `node`, dropped from it on the way."""
    found: list[str] = []
    if isinstance(node, BaseModel):
        extra = node.__pydantic_extra__
        if extra:
            found += [f"{path}{_printable(k)}" for k in extra]
            extra.clear()
        for name in type(node).model_fields:
            found += _unknown(getattr(node, name), f"{path}{name}.")
    elif isinstance(node, list):
        for i, item in enumerate(node):
            if isinstance(item, BaseModel):
                found += _unknown(item, f"{path[:-1]}[{i}].")
    return found


def _printable(name: str) -> str:
    """A client's field name as it may appear in a header and a log line: short, printable ASCII only."""
    clean = "".join(c if c.isascii() and c.isprintable() and c not in ",\"" else "?" for c in name[:64])
    return clean + ("..." if len(name) > 64 else "")


def parse_object(raw: bytes) -> dict[str, Any]:
    """A JSON object body (to choose its model by its keys); a 400 otherwise."""
    try:
        obj = pydantic_core.from_json(raw)
    except ValueError as exc:
        raise invalid(f"the body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise invalid("the body must be a JSON object")
    return obj


# What a field of several shapes may be, for errors that would otherwise name pydantic's union branches.
_SHAPES = {
    "prompt": "must be a non-empty string, a list of non-empty strings, a non-empty list of token ids, or a "
              "list of non-empty token-id lists",
    "stop": f"must be a non-empty string or a list of at most {MAX_STOP} non-empty strings "
            f"(each at most {MAX_STOP_LEN} characters)",
    "early_stopping": 'must be true, false or "never"',
    "tool_choice": 'must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
    "guided_json": "must be a JSON schema (an object, or a string holding one)",
}


def _schema_error(exc: ValidationError) -> ApiError:
    err = exc.errors(include_url=False)[0]
    loc = [str(p) for p in err["loc"]]
    if loc and loc[0] in _SHAPES and err["type"] not in ("extra_forbidden", "missing"):
        return invalid(f"{loc[0]} {_SHAPES[loc[0]]}", loc[0])
    if err["type"] in ("json_invalid", "json_type") or (err["type"] == "model_type" and not loc):
        return invalid(f"the body is not a valid JSON object: {err['msg']}", None)
    if err["type"] == "extra_forbidden":
        where = ".".join(loc)
        return invalid(f"unknown field {where!r}: this server does not accept it (see /openapi.json)",
                           loc[0] if loc else None)
    where = ".".join(loc)
    return invalid(f"{where}: {err['msg']}" if where else err["msg"], loc[0] if loc else None)
