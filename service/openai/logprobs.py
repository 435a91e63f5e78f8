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

import copy
import re
from functools import lru_cache
from typing import Any

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")     # SentencePiece byte fallback


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table, used by byte-level BPE vocabularies."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, (chr(c) for c in cs)))


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


class TokenText:
    """Token id -> (string, bytes), cached: the vocabulary does not change while the server runs.

    NOTE: it decodes with its own copy of the tokenizer, on the event loop and on the threads answers are shaped
    on (sse.shaped): decoding only reads a tokenizer, but an encode on another thread reconfigures the Rust
    object it shares (engine/async_engine.py, "Who owns what")."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = copy.deepcopy(tokenizer)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._byte_level = "ByteLevel" in repr(getattr(backend, "decoder", None))
        self.lookup = lru_cache(maxsize=65536)(self._lookup)

    def _lookup(self, token_id: int) -> tuple[str, list[int]]:
        text = self._tokenizer.decode([token_id], skip_special_tokens=False)
        piece = self._tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            if self._byte_level and piece and all(c in _UNICODE_TO_BYTE for c in piece):
                return text, [_UNICODE_TO_BYTE[c] for c in piece]
            m = _BYTE_TOKEN.match(piece)
            if m:
                return text, [int(m.group(1), 16)]
        return text, list(text.encode("utf-8"))

    def text(self, token_id: int) -> str:
        return self.lookup(token_id)[0]


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
