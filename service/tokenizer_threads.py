"""TokenizerThreads: where request bodies are parsed, rendered and tokenized (never on the event loop).

Two lanes, one thread each, by the size of the body:
- small bodies (under `--large-body-bytes`): the tokenizer thread, with the engine's tokenizer;
- large ones: a thread of their own, with its own copy of the tokenizer.

Why two lanes and not one queue: tokenizing is first come first served per thread, and a 3.9 MiB prompt
takes seconds; eight of them made another client's 2-token completion wait 13 s. Large bodies now wait only
behind each other, and a small request only behind small ones (milliseconds each). Why a copy: a Hugging
Face fast tokenizer is reconfigured by some calls (`split_special_tokens` switches the Rust tokenizer's
`encode_special_tokens`), which is not safe while another thread encodes with it; each thread has its own.
The copy is made on the large lane's thread on its first use (a deepcopy: ~0.1 s) and kept. Both lanes look up
long stretches of chat renderings (a system prompt resent with every request) in one `SegmentTokens`
(service/openai/segments.py).
"""
from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from service.openai.segments import SegmentTokens

T = TypeVar("T")


class TokenizerThreads:
    def __init__(self, large_body_bytes: int) -> None:
        self.large_body_bytes = large_body_bytes
        self.small = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self.large = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize-large")
        self.segments = SegmentTokens()
        self._source: Any = None            # the tokenizer the large lane's copy was made from (large thread only)
        self._copy: Any = None

    async def run(self, size: int, tokenizer: Any, fn: Callable[[Any], T]) -> T:
        """`fn(a tokenizer)` on the lane for a body of `size` bytes: the engine's `tokenizer` on the small lane,
        the large lane's own copy of it there."""
        loop = asyncio.get_running_loop()
        if size < self.large_body_bytes:
            return await loop.run_in_executor(self.small, fn, tokenizer)
        return await loop.run_in_executor(self.large, lambda: fn(self._own(tokenizer)))

    def _own(self, tokenizer: Any) -> Any:
        """The large lane's copy of `tokenizer` (large thread only)."""
        if self._source is not tokenizer:
            self._copy = copy.deepcopy(tokenizer)
            self._source = tokenizer
        return self._copy

    def shutdown(self) -> None:
        self.small.shutdown(wait=False, cancel_futures=True)
        self.large.shutdown(wait=False, cancel_futures=True)
