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
from engine.llm_engine import LLMEngine
from engine.outputs import EngineStats, PinnedPrefix, RequestOutput
from engine.sequence import SamplingParams

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
                prev = acc.get(out.request_id)
                acc[out.request_id] = out.copy() if prev is None else prev.merge(out)
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
