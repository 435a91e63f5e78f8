"""A Messages API request in the chat pipeline's terms (service/openai/pipeline.py takes it from there):

    Anthropic                                   chat
    system (a string or text blocks)            a system message (blocks joined by a blank line)
    user text blocks                            a user message
    user tool_result blocks                     tool messages (before the turn's text), tool_call_id = tool_use_id
    assistant text + tool_use blocks            an assistant message with tool_calls (arguments: the input, as JSON)
    thinking / redacted_thinking blocks         dropped
    tools {name, description, input_schema}     function tools
    tool_choice auto | any | tool | none        "auto" | "required" | {"function": name} | "none" ("any" with
                                                one tool: that one, named: its input is generated directly);
                                                disable_parallel_tool_use -> parallel_tool_calls false
    max_tokens, stop_sequences, temperature,    max_tokens, stop, temperature, top_p, top_k
    top_p, top_k
    max_tokens 0 with a cache_control           a pre-warm: the prompt is written and held, nothing generated
    breakpoint

`cache_control` breakpoints (at most 4, on tools, system blocks and message blocks) become `Breakpoint`s: the
chat body cut just after the marked block, whose rendering's common token prefix with the whole prompt is
the prefix the breakpoint holds (`positions`, on the tokenizer thread: the chat template decides where a
block's tokens end).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from service.anthropic.schema import (
    MAX_BREAKPOINTS,
    TTL_SECONDS,
    CacheControl,
    Message,
    MessagesRequest,
    OtherBlock,
    TextBlock,
    ThinkingBlock,
    ToolResultBlock,
    ToolUseBlock,
    _Conversation,
)
from service.errors import invalid
from service.openai.render import render_messages, template_messages
from service.openai.schema import ChatMessage
from service.openai.segments import SegmentTokens

SYSTEM_JOIN = "\n\n"


@dataclass(frozen=True)
class Breakpoint:
    ttl: float                          # seconds
    messages: list[dict[str, Any]]      # the chat messages up to and including the marked block
    tools: list[dict[str, Any]] | None  # the chat tools up to the marked one (all, past the tools)
    where: str                          # "tools[1]", "system[0]", "messages[2].content[0]"


def tool_use_id(call_id: str) -> str:
    """Our tool call ids as Anthropic spells them (a client only sends them back)."""
    return "toolu_" + call_id.removeprefix("call_")


def _ttl(cc: CacheControl) -> float:
    return TTL_SECONDS[cc.ttl or "5m"]


def _system(req: _Conversation, upto: int | None = None) -> list[dict[str, Any]]:
    system = req.system
    if system is None:
        return []
    text = system if isinstance(system, str) else SYSTEM_JOIN.join(b.text for b in system[:upto])
    return [{"role": "system", "content": text}]


def _text(content: str | list[TextBlock] | None) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(b.text for b in content)


def _turn(m: Message, i: int, upto: int | None = None) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages (its first `upto` blocks)."""
    if isinstance(m.content, str):
        return [{"role": m.role, "content": m.content}]
    texts, calls, results = [], [], []
    for j, block in enumerate(m.content[:upto]):
        if isinstance(block, OtherBlock):
            raise invalid(f"messages[{i}].content[{j}]: content blocks of type {block.type!r} are not supported: "
                          "this server serves a text-only model (text, tool_use and tool_result blocks)", "messages")
        if isinstance(block, TextBlock):
            texts.append(block.text)
        elif isinstance(block, ToolUseBlock):
            if m.role != "assistant":
                raise invalid(f"messages[{i}].content[{j}]: tool_use blocks belong to assistant messages", "messages")
            calls.append({"id": block.id, "type": "function", "function": {
                "name": block.name, "arguments": json.dumps(block.input, ensure_ascii=False)}})
        elif isinstance(block, ToolResultBlock):
            if m.role != "user":
                raise invalid(f"messages[{i}].content[{j}]: tool_result blocks belong to user messages", "messages")
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content)})
        else:
            assert isinstance(block, ThinkingBlock)     # another model's reasoning: not shown to this one
    out: list[dict[str, Any]] = list(results)
    text = SYSTEM_JOIN.join(texts)
    if calls:
        out.append({"role": "assistant", "content": text, "tool_calls": calls})
    elif text or not results:
        out.append({"role": m.role, "content": text})
    return out


def _tools(req: _Conversation, upto: int | None = None) -> list[dict[str, Any]] | None:
    if not req.tools:
        return None
    return [{"type": "function", "function": {"name": t.name, "parameters": t.input_schema,
                                              **({"description": t.description} if t.description else {})}}
            for t in req.tools[:upto]]


def chat_messages(req: _Conversation) -> list[dict[str, Any]]:
    messages = _system(req)
    for i, m in enumerate(req.messages):
        messages += _turn(m, i)
    return messages


def chat_body(req: _Conversation) -> dict[str, Any]:
    """The chat request the pipeline runs (the module docstring's table)."""
    body: dict[str, Any] = {"model": req.model, "messages": chat_messages(req)}
    tools = _tools(req)
    if tools:
        body["tools"] = tools
    choice = req.tool_choice
    if choice is not None:
        only = req.tools[0].name if req.tools and len(req.tools) == 1 and choice.type == "any" else None
        if choice.type == "tool" or only is not None:
            name = choice.name if only is None else only
            if name is None:
                raise invalid("tool_choice of type tool needs a name", "tool_choice")
            body["tool_choice"] = {"type": "function", "function": {"name": name}}
        elif tools or choice.type != "none":
            body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if req.cache_salt is not None:
        body["cache_salt"] = req.cache_salt
    fmt = req.output_config.format if req.output_config is not None else None
    if fmt is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt.schema_}}
    if isinstance(req, MessagesRequest):
        body["max_tokens"] = req.max_tokens
        for src, dst in (("stop_sequences", "stop"), ("temperature", "temperature"), ("top_p", "top_p"),
                         ("top_k", "top_k"), ("stream", "stream")):
            value = getattr(req, src)
            if value is not None:
                body[dst] = value
        if req.stream:
            body["stream_options"] = {"include_usage": True}
    else:
        body["max_tokens"] = 1
    return body


def breakpoints(req: _Conversation) -> list[Breakpoint]:
    """The request's cache_control breakpoints, in prompt order (tools, system, messages)."""
    out: list[Breakpoint] = []
    all_tools = _tools(req)
    for k, tool in enumerate(req.tools or []):
        if tool.cache_control is not None:
            out.append(Breakpoint(_ttl(tool.cache_control), [], _tools(req, k + 1), f"tools[{k}]"))
    if isinstance(req.system, list):
        for j, block in enumerate(req.system):
            if block.cache_control is not None:
                out.append(Breakpoint(_ttl(block.cache_control), _system(req, j + 1), all_tools, f"system[{j}]"))
    head = _system(req)
    for i, m in enumerate(req.messages):
        if not isinstance(m.content, str):
            for j, part in enumerate(m.content):
                cc = getattr(part, "cache_control", None)
                if cc is not None:
                    out.append(Breakpoint(_ttl(cc), head + _turn(m, i, j + 1), all_tools,
                                          f"messages[{i}].content[{j}]"))
        head = head + _turn(m, i)
    if req.cache_control is not None:       # automatic: on the last cacheable block, the whole conversation
        out.append(Breakpoint(_ttl(req.cache_control), head, all_tools, "cache_control"))
    if len(out) > MAX_BREAKPOINTS:
        raise invalid(f"a request may hold at most {MAX_BREAKPOINTS} cache_control breakpoints; this one holds "
                      f"{len(out)} ({out[MAX_BREAKPOINTS].where} is the fifth)", "cache_control")
    return out


def positions(points: list[Breakpoint], prompt: list[int], tokenizer: Any, render_tools: bool,
              segments: SegmentTokens | None = None, salt: str | None = None) -> list[int]:
    """Per breakpoint, how many of the prompt's leading tokens it holds: the common prefix of the prompt and the
    rendering of the conversation cut after the marked block (its long stretches, the system prompt, looked up in
    `segments` under the caller's `salt`). NOTE: on the tokenizer thread."""
    out = []
    for p in points:
        if not p.messages:
            out.append(0)       # a breakpoint on the tools with nothing after: the template decides where they go
            continue
        clean = template_messages([ChatMessage.model_validate(m) for m in p.messages])
        try:
            ids = render_messages(clean, tokenizer, add_generation_prompt=False,
                                  tools=p.tools if render_tools else None, segments=segments, salt=salt)
        except Exception:       # a template that will not render a cut conversation: the breakpoint holds nothing
            out.append(0)
            continue
        n = next((i for i, (x, y) in enumerate(zip(ids, prompt)) if x != y), min(len(ids), len(prompt)))
        out.append(n)
    return out


def sections(req: _Conversation) -> tuple[Any, Any, list[Any]]:
    """What a miss diagnosis compares (service/cache_diagnosis.py): the tools, the system prompt and each
    message, without their cache_control marks (moving a breakpoint changes no token)."""
    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k != "cache_control"}
        if isinstance(value, list):
            return [strip(v) for v in value]
        return value
    tools = strip([t.model_dump(exclude_none=True) for t in req.tools or []])
    system = req.system if isinstance(req.system, str) or req.system is None else \
        strip([b.model_dump(exclude_none=True) for b in req.system])
    return tools, system, [strip(m.model_dump(exclude_none=True)) for m in req.messages]
