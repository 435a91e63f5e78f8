"""The request schema: typed pydantic models for every JSON body the service accepts.

One source of truth: validation (strict types, ranges, unknown fields refused) and /openapi.json
(service/openapi.py) both come from these models. A field is either honoured or refused with a 400 that
names it; unknown fields are refused, except the documented extensions below.

Extensions beyond the OpenAI API (vLLM's names where vLLM has the field):
  prefix                     name of a registered prefix to put before the prompt (ours)
  top_k, min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos,
  best_of (chat too), use_beam_search, length_penalty, early_stopping, return_token_ids,
  guided_json, guided_regex, guided_choice (completions), skip_special_tokens,
  include_stop_str_in_output, add_generation_prompt and continue_final_message (chat)  (vLLM's)
  no_stop_trim (= include_stop_str_in_output), return_hidden_states (false only),
  separate_reasoning, stream_reasoning, include_reasoning (true only)                   (SGLang's)

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
    """Strict types (no "5" for 5, no 1 for true), unknown fields refused."""

    model_config = ConfigDict(strict=True, extra="forbid")


class StreamOptions(_Strict):
    include_usage: bool = False


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

    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class _Sampling(_Strict):
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
    prefix: str | None = None
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

    @field_validator("logit_bias")
    @classmethod
    def _token_keys(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        if v is not None:
            for key in v:
                if not key.isdigit():
                    raise ValueError(f"logit_bias keys must be token ids (decimal strings), got {key!r}")
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


NAME_PATTERN = r"^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$"     # no "." or ".." alone, no trailing newline
MAX_DESCRIPTION = 4096


class PrefixRequest(_Strict):
    """Exactly one of `prompt` (tokenized as completions do) or `messages` (through the chat template,
    no generation prompt)."""

    name: Annotated[str, Field(pattern=NAME_PATTERN)]
    prompt: Annotated[str, Field(min_length=1)] | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
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


def parse_model(model: type[_Strict], raw: bytes | str | dict[str, Any]) -> Any:
    """`raw` (JSON bytes or text, or an already parsed object) as `model`; a 400 naming the field otherwise."""
    try:
        if isinstance(raw, dict):
            return model.model_validate(raw)
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise _schema_error(exc) from None


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
