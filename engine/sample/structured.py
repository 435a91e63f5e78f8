"""Structured output: constrained decoding with xgrammar.

A request's `StructuredSpec` (JSON, a JSON schema, a regex, a choice, or an EBNF grammar) compiles once
per distinct spec (`Grammars`, a thread-safe cache: the service compiles on its tokenizer thread, so a
bad spec is a 400 before the request reaches the engine, and the engine thread only hits the cache).
Each constrained sequence gets a matcher when it first samples; every step, the constrained rows of the
batch get their allowed-token bitmask filled and applied to their logits (unconstrained rows are not
touched), and the sampled token advances the matcher. EOS is allowed only where the grammar may end;
a grammar that ended ends the sequence. Forks (n > 1) fork the matcher; preemption needs nothing (the
matcher follows tokens, not KV).

Why xgrammar over llguidance, measured on this 2-core CPU with SmolLM2's 49,152-token vocabulary and a
4-field JSON schema (36-token answer): mask 9 us per token median (llguidance 41 us), schema compile
64 ms then a cache hit (17 ms), tokenizer setup 1.5 s (3.1 s). Both need no GPU; xgrammar is what vLLM
and SGLang use by default. At 9 us a row the masks cost far less than a forward pass (tens of ms here),
so they are filled right before sampling rather than overlapped with it.
"""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from typing import Any, Literal

import torch

from engine.errors import InvalidRequest

Kind = Literal["json", "json_schema", "regex", "choice", "grammar"]


@dataclass(frozen=True)
class StructuredSpec:
    """What a constrained request's output must match. `value`: the schema (JSON text), the regex, the
    EBNF grammar, or the choices (a JSON list); unused for plain JSON."""

    kind: Kind
    value: str = ""
    param: str = "response_format"     # the request field it came from, for errors

    @classmethod
    def choice(cls, options: list[str], param: str = "guided_choice") -> StructuredSpec:
        return cls("choice", json.dumps(options), param)


class Grammars:
    """Compiled grammars for one tokenizer, cached by spec. Thread-safe."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr
        self._xgr = xgr
        self.vocab_size = vocab_size
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                       stop_token_ids=stop_token_ids or None)
        self._compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._lock = threading.Lock()
        self._cache: dict[StructuredSpec, Any] = {}

    def compile(self, spec: StructuredSpec) -> Any:
        """The compiled grammar; InvalidRequest naming the spec's field when it does not compile."""
        with self._lock:
            hit = self._cache.get(spec)
        if hit is not None:
            return hit
        try:
            compiled = self._compile(spec)
        except Exception as exc:            # xgrammar raises RuntimeError / ValueError with its parse error
            raise InvalidRequest(f"the {spec.kind.replace('_', ' ')} constraint does not compile: {exc}",
                                 param=spec.param) from None
        with self._lock:
            self._cache[spec] = compiled
        return compiled

    def _compile(self, spec: StructuredSpec) -> Any:
        c = self._compiler
        if spec.kind == "json":
            any_object = self._xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False)
            return c.compile_grammar(str(any_object))
        if spec.kind == "json_schema":
            # NOTE: compact separators (a model does not wander into whitespace), and strings whose
            # length the schema bounds kept free of raw control characters: xgrammar's length-bounded
            # string rule admits U+0000-U+001F, which JSON forbids unescaped.
            grammar = self._xgr.Grammar.from_json_schema(spec.value, any_whitespace=False, strict_mode=True)
            ebnf = str(grammar).replace('[^\\"\\\\\\r\\n]', '[^\\0-\\x1f\\"\\\\]')
            return c.compile_grammar(ebnf)
        if spec.kind == "regex":
            return c.compile_regex(spec.value)
        if spec.kind == "choice":
            options = json.loads(spec.value)
            rule = " | ".join(json.dumps(o) for o in options)
            return c.compile_grammar(f"root ::= {rule}")
        return c.compile_grammar(spec.value)

    def matcher(self, spec: StructuredSpec) -> Any:
        return self._xgr.GrammarMatcher(self.compile(spec))

    def bitmask(self, rows: int) -> torch.Tensor:
        return self._xgr.allocate_token_bitmask(rows, self.vocab_size)

    def apply(self, logits: torch.Tensor, matchers: list[Any]) -> None:
        """Masks `logits` [len(matchers), V] in place to what each matcher allows next."""
        mask = self.bitmask(len(matchers))
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)
        self._xgr.apply_token_bitmask_inplace(logits, mask.to(logits.device))
