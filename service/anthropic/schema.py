"""The Messages API's request bodies (Anthropic's shapes): typed models, the one source of validation and of
/openapi.json for POST /v1/messages and /v1/messages/count_tokens.

The field policy is the generation endpoints' (service/openai/schema.py): strict types, a wrong value of a
known field is a 400 naming it, an unknown field is dropped and named in `X-Ignored-Fields` (refused under
`--strict-fields`). Content blocks are text, tool_use and tool_result; thinking blocks a client echoes back
are accepted and dropped; any other block type (image, document, ...) parses as `OtherBlock`, which the
translation refuses with a 400 naming its type (service/anthropic/translate.py).

Accepted, no effect here: `metadata` (user_id), `thinking` (the model does not reason), `service_tier`,
`container`, `inference_geo`, `speed`, `output_config.effort`, a text block's `citations`, a tool's `type:
"custom"`. Honoured: the top-level `cache_control` (a breakpoint on the last cacheable block) and
`output_config.format` (a JSON schema the answer follows). Extensions: `cache_salt` (vLLM's: narrows
the cache within the caller's tenant), `diagnostics.previous_message_id` honoured with or without the
`cache-diagnosis-2026-04-07` beta header.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Discriminator, Field, Tag

from service.openai.schema import MAX_MESSAGES, MAX_STOP, MAX_TOOLS, CacheKey, NonEmptyStr, StopStr, _Strict, bounds

MAX_BREAKPOINTS = 4          # cache_control breakpoints per request (Anthropic's limit)
TTL_SECONDS = {"5m": 300.0, "1h": 3600.0}


class CacheControl(_Strict):
    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None          # default 5m


class TextBlock(_Strict):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None
    citations: list[Any] | None = None              # no effect


class ToolUseBlock(_Strict):
    type: Literal["tool_use"]
    id: NonEmptyStr
    name: NonEmptyStr
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Strict):
    type: Literal["tool_result"]
    tool_use_id: NonEmptyStr
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


class ThinkingBlock(_Strict):
    """A reasoning block a client sends back from another model: dropped (this one does not reason)."""

    type: Literal["thinking", "redacted_thinking"]
    thinking: str | None = None
    signature: str | None = None
    data: str | None = None


class OtherBlock(_Strict):
    """Any other block type (image, document, search_result, server tool blocks, ...): refused, by name."""

    type: str


_KNOWN = {"text": "text", "tool_use": "tool_use", "tool_result": "tool_result", "thinking": "thinking",
          "redacted_thinking": "thinking"}


def _block_tag(v: Any) -> str:
    kind = v.get("type") if isinstance(v, dict) else getattr(v, "type", None)
    return _KNOWN.get(kind, "other") if isinstance(kind, str) else "other"


ContentBlock = Annotated[Annotated[TextBlock, Tag("text")] | Annotated[ToolUseBlock, Tag("tool_use")]
                         | Annotated[ToolResultBlock, Tag("tool_result")] | Annotated[ThinkingBlock, Tag("thinking")]
                         | Annotated[OtherBlock, Tag("other")], Discriminator(_block_tag)]


class Message(_Strict):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
    description: str | None = None
    input_schema: dict[str, Any]
    type: Literal["custom"] | None = None           # client tools only; server tools (web search, ...) are refused
    cache_control: CacheControl | None = None


class ToolChoice(_Strict):
    type: Literal["auto", "any", "tool", "none"]
    name: NonEmptyStr | None = None                 # type "tool"
    disable_parallel_tool_use: bool | None = None


class Metadata(_Strict):
    user_id: Annotated[str, Field(max_length=256)] | None = None


class OutputFormat(_Strict):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")

    model_config = ConfigDict(strict=True, extra="allow", populate_by_name=True)


class OutputConfig(_Strict):
    format: OutputFormat | None = None               # structured output: the answer follows the schema
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None    # no effect


class Diagnostics(_Strict):
    previous_message_id: str | None = None


class _Conversation(_Strict):
    model: NonEmptyStr
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: dict[str, Any] | None = None           # no effect
    cache_salt: CacheKey | None = None               # vLLM's, ours here too
    cache_control: CacheControl | None = None        # a breakpoint on the last cacheable block
    output_config: OutputConfig | None = None


class MessagesRequest(_Conversation):
    max_tokens: Annotated[int, bounds("max_tokens")]     # 0 only with a cache_control breakpoint (a warm-up)
    stop_sequences: Annotated[list[StopStr], Field(max_length=MAX_STOP)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    top_p: Annotated[float, bounds("top_p")] | None = None
    top_k: Annotated[int, Field(ge=1)] | None = None
    stream: bool | None = None
    metadata: Metadata | None = None                  # no effect
    service_tier: Literal["auto", "standard_only"] | None = None    # no effect: one tier
    container: str | dict[str, Any] | None = None     # no effect
    inference_geo: str | None = None                  # no effect
    speed: Literal["standard", "fast"] | None = None  # no effect
    diagnostics: Diagnostics | None = None


class CountTokensRequest(_Conversation):
    pass
