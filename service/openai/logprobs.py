"""Log-probabilities in OpenAI's two shapes, from the engine's per-token `{token_id: logprob}` dicts.

The engine gives, per generated token, a dict of the top-k tokens plus the sampled one (so k or k + 1
entries), log-probabilities of the raw logits. Completions (legacy) and chat present them differently:

    completions: {"tokens": [str], "token_logprobs": [float], "top_logprobs": [{str: float}],
                  "text_offset": [int]}
    chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}

A token's string is `decode([id])` (special tokens kept); its `bytes` are the token's own bytes, so a
token that holds half of a UTF-8 character still reports its byte (its string is then U+FFFD).
`text_offset` counts characters of those token strings from the start of the choice's text, as vLLM does.
"""
from __future__ import annotations

from typing import Any

from service.token_text import TokenText


class CompletionLogprobs:
    """Legacy completions shape; keeps each choice's running text offset across streamed chunks."""

    def __init__(self, tokens: TokenText) -> None:
        self._tokens = tokens
        self._offsets: dict[int, int] = {}      # choice index -> characters of token strings so far

    def format(self, index: int, token_ids: list[int], logprobs: list[dict[int, float] | None]) -> dict[str, Any]:
        """`logprobs[i]` None: nothing predicts that token (an echoed prompt's first): null in the answer."""
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        offset = self._offsets.get(index, 0)
        for token_id, top in zip(token_ids, logprobs):
            text = self._tokens.text(token_id)
            out["tokens"].append(text)
            out["text_offset"].append(offset)
            offset += len(text)
            if top is None:
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                continue
            out["token_logprobs"].append(top[token_id])
            ranked: dict[str, float] = {}
            for tid, lp in sorted(top.items(), key=lambda kv: -kv[1]):
                ranked.setdefault(self._tokens.text(tid), lp)   # two ids, one string: keep the likelier
            out["top_logprobs"].append(ranked)
        self._offsets[index] = offset
        return out


def chat_logprobs(tokens: TokenText, token_ids: list[int], logprobs: list[dict[int, float] | None],
                  top_k: int) -> dict[str, Any]:
    """Chat shape: every sampled token, and the `top_k` most likely alternatives at its place."""
    content = []
    for token_id, top in zip(token_ids, logprobs):
        assert top is not None, "chat answers hold sampled tokens only"
        ranked = sorted(top.items(), key=lambda kv: -kv[1])[:top_k]
        content.append({**_entry(tokens, token_id, top[token_id]),
                        "top_logprobs": [_entry(tokens, tid, lp) for tid, lp in ranked]})
    return {"content": content}


def _entry(tokens: TokenText, token_id: int, logprob: float) -> dict[str, Any]:
    text, raw = tokens.lookup(token_id)
    return {"token": text, "logprob": logprob, "bytes": raw}
