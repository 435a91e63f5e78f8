"""The tool-call parsers and schemas, on strings: Hermes / Qwen2.5 and Llama 3.1 syntaxes, the schemas
that constrain "required" and named calls (checked with jsonschema)."""
from __future__ import annotations

import json

import jsonschema
import pytest

from service.openai.schema import Tool
from service.openai.tools import (
    ToolPlan,
    calls_from_named,
    calls_from_required,
    might_become_a_call,
    named_schema,
    parse_auto,
    required_schema,
)

WEATHER = Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
TIME = Tool.model_validate({"type": "function", "function": {"name": "get_time"}})
NAMES = {"get_weather", "get_time"}


def test_hermes_calls_and_content() -> None:
    text = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' \
           '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    content, calls = parse_auto(text, NAMES)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def test_smollm2_list_of_calls_in_one_tag() -> None:
    """The syntax the built-in model's template asks for (engine/models/templates/smollm2_tools.jinja)."""
    text = '<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "nope", "arguments": {}}, ' \
           '{"name": "get_time", "arguments": {}}]</tool_call>'
    content, calls = parse_auto(text, NAMES)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert parse_auto("<tool_call>[]</tool_call>", NAMES) == ("<tool_call>[]</tool_call>", [])   # no call: content


@pytest.mark.parametrize("text", [
    '{"name": "get_weather", "parameters": {"city": "Oslo"}}',
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Oslo"}}',
])
def test_llama3_json_call(text: str) -> None:
    content, calls = parse_auto(text, NAMES)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", {"city": "Oslo"})]


@pytest.mark.parametrize("text", [
    "Paris is the capital of France.",
    '{"name": "undeclared", "parameters": {}}',           # not a declared tool: content
    "<tool_call>not json</tool_call>",
    '{"name": "get_weather", "parameters": [1]}',          # arguments must be an object
])
def test_answers_without_calls_are_content(text: str) -> None:
    assert parse_auto(text, NAMES) == (text, [])


def test_holding_back_what_may_be_a_call() -> None:
    assert might_become_a_call("") and might_become_a_call(" {") and might_become_a_call("<|python")
    assert might_become_a_call("Sure <tool_") and might_become_a_call("x <tool_call>{")
    assert not might_become_a_call("Sure, Paris") and not might_become_a_call("a < b")


def test_schemas_accept_what_the_mappers_read() -> None:
    args = {"city": "Rome"}
    jsonschema.validate(args, named_schema(WEATHER))
    [call] = calls_from_named(WEATHER, json.dumps(args))
    assert call.name == "get_weather" and json.loads(call.arguments) == args

    many = [{"name": "get_weather", "parameters": args}, {"name": "get_time", "parameters": {}}]
    jsonschema.validate(many, required_schema([WEATHER, TIME], parallel=True))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(many, required_schema([WEATHER, TIME], parallel=False))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([], required_schema([WEATHER, TIME], parallel=True))
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_weather", "parameters": {}}], required_schema([WEATHER], parallel=True))
    assert [c.name for c in calls_from_required(json.dumps(many))] == ["get_weather", "get_time"]


def test_arguments_nested_deeper_than_json_loads_goes() -> None:
    """Issue 34, item 10: a forced ("required") call whose arguments nest thousands of levels deep (what its schema
    allowed, and a model wrote) made json.loads raise RecursionError: a 500. Such arguments now come back as the
    model wrote them; the Hermes / SmolLM2 syntaxes of "auto" read them too; text cut short is still no call."""
    deep = "[" * 5000 + "]" * 5000
    args = '{"a": ' + deep + ', "b": "x"}'
    plan = ToolPlan("required", [WEATHER, TIME])
    content, calls = plan.calls(f'[{{"name": "get_time", "parameters": {args}}}, '
                                '{"name": "get_weather", "parameters": {"city": "Oslo"}}]')
    assert content is None and [(c.name, c.arguments) for c in calls] == [("get_time", args),
                                                                          ("get_weather", '{"city": "Oslo"}')]
    assert calls_from_required(f'[{{"name": "get_time", "parameters": {args}}}]')[0].arguments == args
    cut = f'[{{"name": "get_time", "parameters": {args[:4000]}'
    assert plan.calls(cut) == (cut, [])                                        # cut short by max_tokens
    for text in (f'<tool_call>{{"name": "get_time", "arguments": {args}}}</tool_call>',
                 f'<tool_call>[{{"name": "get_time", "arguments": {args}}}]</tool_call>'):
        content, calls = parse_auto(text, NAMES)
        assert content is None and [(c.name, c.arguments) for c in calls] == [("get_time", args)]
    content, calls = parse_auto(f'<tool_call>{{"name": "get_time", "arguments": {deep}}}</tool_call>', NAMES)
    assert calls == []                                                         # not an object: no call
    with pytest.raises(ValueError):
        calls_from_required('[{"name": "get_time", "parameters": ' + "[" * 5000 + "]" * 4999 + "}" + "}]")
