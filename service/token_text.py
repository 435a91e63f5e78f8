"""TokenText: a token id's string and bytes, as logprobs show them (OpenAI's two shapes: openai/logprobs.py).

Held by the service's state (one per loaded engine: ServiceState.token_text) and used by every surface that
shows logprobs (completions, chat, the WebSocket).
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
