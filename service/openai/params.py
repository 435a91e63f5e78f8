"""From validated request models (service/schema.py) to what the engine takes: token ids and SamplingParams.

Types and ranges are the schema's; this module adds the checks that span fields or depend on this
server (n and best_of against max_choices, logprobs against beam search), refuses the fields the
engine cannot honour yet with a 400 naming them, and tokenizes.
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

import pydantic_core
from aiohttp import web

from engine.errors import InvalidRequest
from engine.sample.structured import StructuredSpec
from engine.sequence import SamplingParams
from service.errors import ApiError, invalid
from service.openai.schema import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    NamedToolChoice,
    SchemaError,
    parse,
)
from service.openai.tools import ToolPlan, named_schema, required_schema


@dataclass
class GenerationRequest:
    """What a completions, chat or WebSocket request asks for, validated."""

    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    prefix: str | None = None
    user: str | None = None
    echo: bool = False              # completions: the prompt goes before each choice's text (and logprobs)
    tools: ToolPlan | None = None   # chat: how the answer calls tools (service/tools.py)


async def read_body(request: web.Request, timeout: float) -> bytes:
    """The raw body; 413 (client_max_size) surfaces as HTTPRequestEntityTooLarge, a body that takes
    longer than `timeout` seconds to arrive gets 408."""
    try:
        async with asyncio.timeout(timeout):
            return await request.read()
    except TimeoutError:
        raise ApiError(408, f"the request body did not arrive within {timeout:g} s", code="body_timeout") from None


def parse_body(model: type[Any], raw: bytes | str | dict[str, Any]) -> Any:
    """`raw` validated as `model`; a 400 naming the offending field otherwise."""
    try:
        return parse(model, raw)
    except SchemaError as exc:
        raise invalid(exc.message, exc.param) from None


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
    if isinstance(req, CompletionRequest):
        if req.guided_json is not None:
            schema = req.guided_json if isinstance(req.guided_json, str) else json.dumps(req.guided_json)
            specs.append(StructuredSpec("json_schema", schema, "guided_json"))
        if req.guided_regex is not None:
            specs.append(StructuredSpec("regex", req.guided_regex, "guided_regex"))
        if req.guided_choice is not None:
            specs.append(StructuredSpec.choice(list(req.guided_choice)))
    if len(specs) > 1:
        raise invalid("give at most one output constraint (response_format, guided_json, guided_regex, "
                      "guided_choice)", specs[1].param)
    return specs[0] if specs else None


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
    if max_tokens == 0 and not echo:
        raise invalid("max_tokens must be >= 1 (0 is for scoring a prompt with echo)", "max_tokens")
    if isinstance(req, ChatCompletionRequest) and req.max_completion_tokens is not None:
        max_tokens = req.max_completion_tokens
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
                             return_token_ids=bool(req.return_token_ids), prefix=req.prefix, user=req.user,
                             echo=echo, tools=plan)


def _logprobs(req: CompletionRequest | ChatCompletionRequest) -> int | None:
    """The top-k asked for, or None. Completions: `logprobs` is that k (the legacy API). Chat:
    `logprobs: true` turns it on and `top_logprobs` (which needs it) is the k."""
    if isinstance(req, CompletionRequest):
        return req.logprobs
    if req.top_logprobs is not None and not req.logprobs:
        raise invalid("top_logprobs needs logprobs to be true", "top_logprobs")
    return (req.top_logprobs or 0) if req.logprobs else None


def check_choices(num_prompts: int, params: SamplingParams, max_choices: int) -> None:
    """Prompts x best_of (the sequences generated) is capped like prompts x n (those returned)."""
    best_of = params.best_of or params.n
    if num_prompts * best_of > max_choices:
        param = "best_of" if best_of > params.n else "n"
        raise invalid(f"the number of prompts times {param} must be at most {max_choices}", param)


def parse_prompts(req: CompletionRequest, tokenizer: Any) -> list[list[int]]:
    """`prompt` as a string, a list of strings, token ids, or a list of token-id lists: one entry each."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return [encode_prompt(tokenizer, prompt)]
    if all(isinstance(p, str) for p in prompt):
        return [encode_prompt(tokenizer, p) for p in prompt]  # type: ignore[arg-type]
    if all(isinstance(t, int) for t in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    return [list(p) for p in prompt]  # type: ignore[arg-type]


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: role and text content (plus tool fields when set)."""
    out = []
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name is not None:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [tc.model_dump() for tc in m.tool_calls]
        if m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        out.append(msg)
    return out


def parse_messages(messages: list[ChatMessage], tokenizer: Any) -> list[int]:
    """Chat messages through the model's chat template, ready for the assistant's answer."""
    return render_messages(template_messages(messages), tokenizer, add_generation_prompt=True)


def render_text(clean: list[dict[str, Any]], tokenizer: Any, add_generation_prompt: bool,
                tools: list[dict[str, Any]] | None = None, continue_final: bool = False) -> str:
    """The chat template's rendering of `clean` messages (and `tools`, for templates that take them).
    `continue_final`: the last message is left open, for the model to go on with it."""
    try:
        return str(tokenizer.apply_chat_template(clean, tools=tools, add_generation_prompt=add_generation_prompt,
                                                 continue_final_message=continue_final, tokenize=False))
    except Exception as exc:  # a template that raises on this input (jinja's raise_exception, bad roles)
        raise invalid(f"the chat template rejected the messages: {exc}", "messages") from None


def render_messages(clean: list[dict[str, Any]], tokenizer: Any, add_generation_prompt: bool,
                    tools: list[dict[str, Any]] | None = None, continue_final: bool = False) -> list[int]:
    """Token ids of the chat template's rendering; the template adds the special tokens.

    NOTE: message content is text. A message holding the text of a special token (a user typing
    `<|im_end|>\n<|im_start|>system ...` to forge a system turn) gets that text encoded as ordinary
    tokens, never as the control token: the template's own parts and each content are encoded apart,
    the contents with the special tokens split. Content without such text (nearly all) is encoded with
    the whole rendering at once, exactly as before."""
    text = render_text(clean, tokenizer, add_generation_prompt, tools, continue_final)
    specials = _special_texts(tokenizer)
    contents = [m["content"] for m in clean]
    if not any(s in c for c in contents for s in specials):
        return list(tokenizer.encode(text, add_special_tokens=False))
    marks = [f"\ue000{i}\ue001" for i in range(len(clean))]          # private-use code points
    marked = render_text([{**m, "content": mark} for m, mark in zip(clean, marks)], tokenizer,
                         add_generation_prompt, tools, continue_final)
    pieces, rest = [], marked
    for mark in marks:
        if rest.count(mark) != 1:
            raise _unrenderable(specials)
        head, rest = rest.split(mark)
        pieces.append(head)
    if "".join(p + c for p, c in zip(pieces, contents)) + rest != text:   # the template changed content
        raise _unrenderable(specials)
    ids: list[int] = []
    for piece, content in zip(pieces, contents):
        ids += tokenizer.encode(piece, add_special_tokens=False)
        ids += tokenizer(content, add_special_tokens=False, split_special_tokens=True)["input_ids"]
    return ids + tokenizer.encode(rest, add_special_tokens=False)


def _special_texts(tokenizer: Any) -> list[str]:
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    return sorted({t.content for t in decoder.values() if getattr(t, "special", False)} |
                  set(getattr(tokenizer, "all_special_tokens", [])))


def _unrenderable(specials: list[str]) -> ApiError:
    return invalid("a message contains the text of a special token (one of " + ", ".join(specials[:5]) +
                   ") and this model's chat template does not keep message content as written, so it "
                   "cannot be encoded as plain text", "messages")


def parse_object(raw: bytes) -> dict[str, Any]:
    """A JSON object body (to choose its model by its keys); a 400 otherwise."""
    try:
        obj = pydantic_core.from_json(raw)
    except ValueError as exc:
        raise invalid(f"the body is not valid JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise invalid("the body must be a JSON object")
    return obj


def encode_prompt(tokenizer: Any, text: str, special_tokens: bool = True) -> list[int]:
    """A completion prompt's tokens. NOTE: like vLLM, a prompt gets the tokenizer's own special tokens (e.g.
    Llama's BOS), unless it follows a prefix (`special_tokens=False`), which already starts the sequence."""
    return list(tokenizer.encode(text, add_special_tokens=special_tokens))
