"""Tool calls for chat completions: what each `tool_choice` makes of the output, and the parsers.

    tool_choice           generation                                    answer
    "none" / no tools     as usual (tools are not shown to the model)   content
    {"function": f}       constrained to f's parameters (JSON schema)   one tool call to f
    "required"            constrained to [{"name", "parameters"}, ...]  one or more tool calls
                          (one item when parallel_tool_calls is false)
    "auto"                tools rendered by the model's chat template;  content, or the tool calls the
                          output parsed for the model family's syntax   model wrote (finish "tool_calls")

"auto" needs a chat template that renders `tools`; with one that ignores them the request is refused
(a model never shown the tools cannot call them), with a message naming the fix (`--chat-template`).
Syntaxes parsed for "auto": Hermes / Qwen2.5 (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`,
several allowed), SmolLM2's (a list in one tag: `<tool_call>[{"name": ..., "arguments": {...}}, ...]</tool_call>`,
what the built-in model's template asks for: engine/models/templates/smollm2_tools.jinja) and Llama 3.1 JSON
(the whole answer one object `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`).
"""
from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from service.openai.schema import Tool

HERMES_START = "<tool_call>"
_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
_PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCallOut:
    name: str
    arguments: str          # a JSON object, as text (what the OpenAI API sends)
    id: str

    def as_dict(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}
        if index is not None:
            out["index"] = index
        return out


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _parameters(tool: Tool) -> dict[str, Any]:
    return tool.function.parameters or {"type": "object", "properties": {}}


def named_schema(tool: Tool) -> dict[str, Any]:
    """The output of a call forced to `tool`: its arguments object."""
    return _parameters(tool)


def required_schema(tools: list[Tool], parallel: bool) -> dict[str, Any]:
    """The output when some tool must be called: a list of {"name", "parameters"} items, one per call."""
    items = [{"type": "object", "properties": {"name": {"const": t.function.name}, "parameters": _parameters(t)},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    schema: dict[str, Any] = {"type": "array", "items": {"anyOf": items} if len(items) > 1 else items[0],
                              "minItems": 1}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def calls_from_named(tool: Tool, text: str) -> list[ToolCallOut]:
    return [ToolCallOut(tool.function.name, _canonical(_load(text, 0)), new_call_id())]


def calls_from_required(text: str) -> list[ToolCallOut]:
    return [ToolCallOut(item["name"], _canonical(item["parameters"]), new_call_id()) for item in _load(text, 2)]


def _canonical(arguments: Any) -> str:
    if isinstance(arguments, Deep):
        return str(arguments)
    return json.dumps(arguments, ensure_ascii=False)


class Deep(str):
    """A JSON value's text, kept as it came: it nests deeper than json.loads goes (about 1,000 levels, then a
    RecursionError; a forced call's arguments may nest that deep: issue 34, item 10)."""


# json's own string scanner (the C one): not in typeshed's stubs, part of the module since Python 2.6
scanstring: Callable[[str, int], tuple[str, int]] = json.decoder.scanstring  # type: ignore[attr-defined]
_SCALAR = re.compile(r"-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][-+]?[0-9]+)?|true|false|null")
_CLOSES = {"]": "[", "}": "{"}


def _load(text: str, levels: int) -> Any:
    """json.loads, except for a text nesting deeper than it goes: that one is read `levels` containers down by
    `_members` (a scan that does not recurse), and each value there that is still too deep is kept as a `Deep`.
    Raises ValueError for text that is not one JSON value (cut short by max_tokens, say)."""
    try:
        return json.loads(text)
    except RecursionError:
        top, members = _members(text)
        if levels == 0:
            return Deep(text.strip())
        values = [(key, _load(value, levels - 1)) for key, value in members]
        return [v for _, v in values] if top == "[" else {key: v for key, v in values}


def _members(text: str) -> tuple[str, list[tuple[str | None, str]]]:
    """The top container of JSON `text` ("[" or "{") and its members: (key, or None in an array; the value's
    text), found by one pass over the tokens with a stack of open brackets (no recursion, however deep).
    Checks the tokens, the brackets' pairing and that nothing follows; raises ValueError otherwise."""
    stack: list[str] = []
    members: list[tuple[str | None, str]] = []
    key: str | None = None
    start = -1                   # where the member value being read began (a container at depth 1)
    after = ""                   # the last token at depth 1: ",", ":", "[" or "{" (a string after ":" is a value)
    i, n, end = 0, len(text), -1
    while i < n:
        c = text[i]
        if c in " \t\r\n":
            i += 1
            continue
        if end >= 0:
            raise ValueError("text after the JSON value")
        if c in "[{":
            if len(stack) == 1:
                start = i
            stack.append(c)
            after = c
            i += 1
        elif c in "]}":
            if not stack or stack.pop() != _CLOSES[c]:
                raise ValueError("brackets that do not pair")
            i += 1
            if len(stack) == 1:
                members.append((key, text[start:i]))
                key = None
            elif not stack:
                end = i
        elif not stack:
            raise ValueError("not a JSON container")
        elif c in ",:":
            after = c if len(stack) == 1 else after
            i += 1
        else:
            if c == '"':
                value, j = scanstring(text, i + 1)
            else:
                m = _SCALAR.match(text, i)
                if m is None:
                    raise ValueError(f"not JSON at character {i}")
                value, j = m.group(), m.end()
            if len(stack) == 1:
                if stack[0] == "{" and after != ":":
                    key = value
                else:
                    members.append((key, text[i:j]))
                    key = None
                after = "value"
            i = j
    if end < 0:
        raise ValueError("the JSON value is cut short")
    return text.lstrip()[0], members


def parse_auto(text: str, tool_names: set[str]) -> tuple[str | None, list[ToolCallOut]]:
    """(content, tool calls) of an "auto" answer. Only calls to declared tools with object arguments
    count; an answer holding none is all content."""
    calls: list[ToolCallOut] = []
    if HERMES_START in text:
        for body in _HERMES.findall(text):
            calls += _calls(body, ("arguments", "parameters"), tool_names)
        if calls:
            content = text[:text.index(HERMES_START)].strip()
            return content or None, calls
        return text, []
    stripped = text.strip()
    if stripped.startswith(_PYTHON_TAG):
        stripped = stripped[len(_PYTHON_TAG):].strip()
    if stripped.startswith("{"):
        call = _call(stripped, ("parameters", "arguments"), tool_names)
        if call is not None:
            return None, [call]
    return text, []


def _calls(body: str, keys: tuple[str, ...], tool_names: set[str]) -> list[ToolCallOut]:
    """The calls in one tag's body: an object, or a list of them (the valid ones)."""
    try:
        obj = _load(body, 2 if body.lstrip().startswith("[") else 1)
    except ValueError:
        return []
    items = obj if isinstance(obj, list) else [obj]
    return [c for c in (_one(item, keys, tool_names) for item in items) if c is not None]


def _call(body: str, keys: tuple[str, ...], tool_names: set[str]) -> ToolCallOut | None:
    try:
        obj = _load(body, 1)
    except ValueError:
        return None
    return _one(obj, keys, tool_names)


def _one(obj: Any, keys: tuple[str, ...], tool_names: set[str]) -> ToolCallOut | None:
    if not isinstance(obj, dict) or obj.get("name") not in tool_names:
        return None
    args: Any = next((obj[k] for k in keys if k in obj), {})
    if not isinstance(args, dict) and not (isinstance(args, Deep) and args.startswith("{")):
        return None
    return ToolCallOut(str(obj["name"]), _canonical(args), new_call_id())


def might_become_a_call(text: str) -> bool:
    """While streaming "auto": whether the text so far may be (the start of) a tool call, so it must be
    held back rather than sent as content."""
    stripped = text.lstrip()
    if not stripped:
        return True
    if stripped.startswith(("{", _PYTHON_TAG)) or _PYTHON_TAG.startswith(stripped):
        return True
    if HERMES_START in text:
        return True
    tail = text[-len(HERMES_START):]
    return any(HERMES_START.startswith(tail[i:]) for i in range(len(tail)))


@dataclass
class ToolPlan:
    """How a chat request's tools shape its answer (the table at the top of this module)."""

    mode: str                       # "auto" | "required" | "named"
    tools: list[Tool]
    named: Tool | None = None
    parallel: bool = True

    @property
    def names(self) -> set[str]:
        return {t.function.name for t in self.tools}

    def template_tools(self) -> list[dict[str, Any]]:
        return [t.model_dump(exclude_none=True) for t in self.tools]

    def calls(self, text: str) -> tuple[str | None, list[ToolCallOut]]:
        """(content, tool calls) of a whole answer."""
        if self.mode == "named":
            assert self.named is not None
            return None, [ToolCallOut(self.named.function.name, text, new_call_id())]
        if self.mode == "required":
            try:
                return None, calls_from_required(text)
            except (ValueError, KeyError, TypeError):      # cut short by max_tokens: not a whole call list
                return text, []
        return parse_auto(text, self.names)


class ToolCallStream:
    """Streaming one choice of a tool-calling chat answer: the `delta` objects to send for each piece
    of text. Named calls stream their arguments as they come; "required" answers are sent whole at the
    end (their JSON names the function only once it is parsed); "auto" answers stream as content until
    the text may be a tool call, which is then held and parsed at the end."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.text = ""
        self.sent = 0                  # characters of `text` sent as content
        self.call_id = new_call_id()
        self.has_calls = False

    def feed(self, piece: str, finished: bool) -> list[dict[str, Any]]:
        self.text += piece
        plan = self.plan
        if plan.mode == "named":
            assert plan.named is not None
            first = self.sent == 0 and not self.has_calls
            self.has_calls = True
            self.sent = len(self.text)
            call: dict[str, Any] = {"index": 0, "function": {"arguments": piece}}
            if first:
                call.update(id=self.call_id, type="function")
                call["function"]["name"] = plan.named.function.name
            return [{"tool_calls": [call]}] if piece or first else []
        if plan.mode == "auto" and not finished:
            if might_become_a_call(self.text[self.sent:]):
                return []
            out = self.text[self.sent:]
            self.sent = len(self.text)
            return [{"content": out}] if out else []
        if not finished:
            return []
        content, calls = plan.calls(self.text[self.sent:] if plan.mode == "auto" else self.text)
        deltas: list[dict[str, Any]] = []
        if content:
            deltas.append({"content": content})
        if calls:
            self.has_calls = True
            deltas.append({"tool_calls": [c.as_dict(index=i) for i, c in enumerate(calls)]})
        self.sent = len(self.text)
        return deltas
