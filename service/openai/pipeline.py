"""Request preparation: parse and validate, resolve the named prefix, tokenize.

    raw body ──(tokenizer thread)──► validated request ──(event loop)──► prefix snapshot ──(tokenizer
    thread)──► token ids

A large body (hundreds of prompts, a long conversation) takes milliseconds to seconds to parse, render
through the chat template and tokenize; done on the event loop it would stall every stream and /health
meanwhile, so those steps run on one tokenizer thread (Hugging Face fast tokenizers are not safe to
reconfigure from several threads at once). The registry belongs to the event loop: the named prefix is
looked up there, between the two, and handed over as an immutable snapshot.

A named prefix composes at the level its source was registered at:
- registered with `messages`, named by a chat request: the chat template renders the prefix's messages
  followed by the request's, once (a template's default system prompt or BOS appears once); the
  registration checked that such a rendering starts with the prefix's pinned tokens;
- registered with `messages` or a `prompt`, named by a completion: the prefix's tokens, then the
  prompt's, encoded without the tokenizer's special tokens (no second BOS);
- registered with a `prompt`, named by a chat request: refused (400); there is no message to put first.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from engine.errors import InvalidRequest
from engine.sample.structured import Grammars
from service.errors import invalid
from service.openai.params import (
    GenerationRequest,
    check_choices,
    check_model,
    encode_prompt,
    parse_body,
    parse_prompts,
    render_messages,
    template_messages,
    to_generation,
)
from service.openai.schema import ChatCompletionRequest, CompletionRequest
from service.openai.tools import template_renders_tools

T = TypeVar("T")


def tokenizer_executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")


async def off_loop(executor: ThreadPoolExecutor, fn: Callable[[], T]) -> T:
    return await asyncio.get_running_loop().run_in_executor(executor, fn)


@dataclass(frozen=True)
class PrefixSnapshot:
    """What a request needs of a registered prefix, copied out of the registry on the event loop."""

    name: str
    token_ids: tuple[int, ...]
    messages: tuple[dict[str, Any], ...] | None      # its source, when it was registered with messages


@dataclass
class Parsed:
    body: CompletionRequest | ChatCompletionRequest
    req: GenerationRequest


def parse_request(raw: bytes | dict[str, Any], chat: bool, served: str, max_choices: int) -> Parsed:
    body = parse_body(ChatCompletionRequest if chat else CompletionRequest, raw)
    check_model(body.model, served)
    return Parsed(body, to_generation(body, max_choices=max_choices))


def tokenize(parsed: Parsed, tokenizer: Any, prefix: PrefixSnapshot | None, max_choices: int,
             grammars: Callable[[], Grammars]) -> list[list[int]]:
    """The prompts' token ids, the named prefix composed in (see the module docstring). A structured
    output constraint is compiled here too (a bad one is a 400; the engine then finds it cached)."""
    body = parsed.body
    spec = parsed.req.params.structured
    if spec is not None:
        try:
            grammars().compile(spec)
        except InvalidRequest as exc:
            raise invalid(exc.message, exc.param) from None
    if isinstance(body, ChatCompletionRequest):
        messages = template_messages(body.messages)
        if prefix is not None:
            if prefix.messages is None:
                raise invalid(f"prefix {prefix.name!r} was registered with a prompt; a chat request can only name "
                              "a prefix registered with messages", "prefix")
            messages = [dict(m) for m in prefix.messages] + messages
        plan = parsed.req.tools
        if plan is not None and plan.mode == "auto" and not template_renders_tools(tokenizer):
            raise invalid("this model's chat template does not show tools to the model, so it cannot choose to call "
                          "one: use tool_choice \"required\" or name a function", "tool_choice")
        tools = plan.template_tools() if plan is not None else None
        cont = bool(body.continue_final_message)
        return [render_messages(messages, tokenizer, add_generation_prompt=body.add_generation_prompt is not False
                                and not cont, tools=tools, continue_final=cont)]
    if prefix is None:
        prompts = parse_prompts(body, tokenizer)
    else:
        head = list(prefix.token_ids)
        prompt = body.prompt
        if isinstance(prompt, str):
            prompts = [head + encode_prompt(tokenizer, prompt, special_tokens=False)]
        elif all(isinstance(p, str) for p in prompt):
            prompts = [head + encode_prompt(tokenizer, p, special_tokens=False) for p in prompt]  # type: ignore[arg-type]
        else:
            prompts = [head + p for p in parse_prompts(body, tokenizer)]
    check_choices(len(prompts), parsed.req.params, max_choices)
    return prompts
