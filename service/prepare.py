"""Request preparation off the event loop: parse, validate and tokenize on the service's tokenizer thread.

A large body (hundreds of prompts, a long conversation) takes milliseconds to seconds to parse, render
through the chat template and tokenize; done on the event loop it would stall every stream and /health
meanwhile. The handlers await `off_loop(...)` instead. One thread: Hugging Face fast tokenizers are
not safe to reconfigure from several threads at once, and one thread keeps the loop free, which is
the point.
"""
from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from service.protocol import (
    GenerationRequest,
    check_choices,
    check_model,
    parse_body,
    parse_messages,
    parse_prompts,
    to_generation,
)
from service.schema import ChatCompletionRequest, CompletionRequest

T = TypeVar("T")


def tokenizer_executor() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")


async def off_loop(executor: ThreadPoolExecutor, fn: Callable[[], T]) -> T:
    return await asyncio.get_running_loop().run_in_executor(executor, fn)


@dataclass
class Prepared:
    body: CompletionRequest | ChatCompletionRequest
    req: GenerationRequest
    prompts: list[list[int]]


def prepare_completion(raw: bytes | dict[str, Any], tokenizer: Any, served: str, max_choices: int) -> Prepared:
    body = parse_body(CompletionRequest, raw)
    check_model(body.model, served)
    req = to_generation(body, max_choices=max_choices)
    prompts = parse_prompts(body, tokenizer)
    check_choices(len(prompts), req.params, max_choices)
    return Prepared(body, req, prompts)


def prepare_chat(raw: bytes | dict[str, Any], tokenizer: Any, served: str, max_choices: int) -> Prepared:
    body = parse_body(ChatCompletionRequest, raw)
    check_model(body.model, served)
    req = to_generation(body, max_choices=max_choices)
    return Prepared(body, req, [parse_messages(body.messages, tokenizer)])
