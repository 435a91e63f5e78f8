"""LLM: the offline, vLLM-shaped API.

    llm = LLM(model="path", block_size=16)
    outs = llm.generate(["a prompt", [1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=32))
"""
from __future__ import annotations

import itertools
from collections.abc import Sequence as Seq
from typing import Any

from tqdm import tqdm

from engine.config import EngineConfig
from engine.llm_engine import EngineStats, LLMEngine, PinnedPrefix
from engine.sequence import CompletionOutput, RequestOutput, SamplingParams

Prompt = str | list[int]


class LLM:
    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        self.engine = LLMEngine(EngineConfig(model=model, **kwargs))
        self.tokenizer = self.engine.tokenizer
        self._ids = itertools.count()

    def encode(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return list(self.tokenizer.encode(prompt, add_special_tokens=False))
        return list(prompt)

    def generate(self, prompts: Prompt | Seq[Prompt], params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Runs every prompt to completion; outputs come back in prompt order, text cumulative."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        plist = list(prompts)  # type: ignore[arg-type]
        if params is None:
            params = SamplingParams()
        per = list(params) if isinstance(params, (list, tuple)) else [params] * len(plist)
        order: dict[str, int] = {}
        acc: dict[str, RequestOutput] = {}
        for i, (p, sp) in enumerate(zip(plist, per)):
            rid = f"offline-{next(self._ids)}"
            self.engine.add_request(rid, self.encode(p), sp)  # type: ignore[arg-type]
            order[rid] = i
        bar = tqdm(total=len(plist), disable=not use_tqdm, desc="generate")
        while self.engine.has_unfinished():
            for out in self.engine.step():
                acc[out.request_id] = _merge(acc.get(out.request_id), out)
                if out.finished:
                    bar.update(1)
        bar.close()
        return [acc[rid] for rid in sorted(acc, key=order.__getitem__)]

    def pin_prefix(self, prompt: Prompt) -> PinnedPrefix:
        return self.engine.pin_prefix(self.encode(prompt))

    def unpin_prefix(self, prompt: Prompt) -> int:
        return self.engine.unpin_prefix(self.encode(prompt))

    def stats(self) -> EngineStats:
        return self.engine.stats()


def _merge(prev: RequestOutput | None, delta: RequestOutput) -> RequestOutput:
    """Accumulates streamed deltas into one cumulative output per request."""
    if prev is None:
        return RequestOutput(delta.request_id, delta.prompt_token_ids,
                             [CompletionOutput(o.index, o.text, list(o.token_ids), o.finish_reason, o.stop_reason,
                                               o.cumulative_logprob, list(o.logprobs) if o.logprobs else o.logprobs)
                              for o in delta.outputs],
                             delta.finished, delta.num_cached_tokens)
    by_index = {o.index: o for o in prev.outputs}
    for o in delta.outputs:
        cur = by_index.get(o.index)
        if cur is None:
            prev.outputs.append(CompletionOutput(o.index, o.text, list(o.token_ids), o.finish_reason,
                                                 o.stop_reason, o.cumulative_logprob, o.logprobs))
            continue
        cur.text += o.text
        cur.token_ids.extend(o.token_ids)
        cur.finish_reason, cur.stop_reason, cur.cumulative_logprob = o.finish_reason, o.stop_reason, o.cumulative_logprob
        if o.logprobs:
            cur.logprobs = (cur.logprobs or []) + o.logprobs
    prev.outputs.sort(key=lambda o: o.index)
    prev.finished = delta.finished
    prev.num_cached_tokens = delta.num_cached_tokens
    return prev
