"""SegmentTokens: the token ids of long stretches of prompt text, kept, so that a system prompt sent again with every
request is encoded once.

Why: chat products resend the same long system prompt with each request. Encoding an 8,034-token one took ~45 ms
of the tokenizer thread, and 16 requests that arrive together (the peers benchmark's long8k load) made ~0.7 s of
tokenizer work beside the engine's first prefill chunk on a 2-core machine: that chunk took 4.4 s instead of 2.4 s,
and the load's TTFT p90 was 21.3 s against 19.7 s with the same prompts sent as token ids.

How: a rendered prompt is cut at the texts of the tokenizer's added tokens, which a Hugging Face tokenizer splits off
before anything else, so each stretch between them encodes on its own. A stretch of MIN_CHARS characters or more is
looked up by its digest and the caller's cache salt: as with the KV cache (service/tenants.py), a tenant never hits
another tenant's text, so no answer comes sooner for what another sent. Whether the cut gives the tokenizer's own
ids is checked once per tokenizer, on probes with spaces and newlines on both sides of every special token; where
it does not (special tokens that take the spaces beside them, a SentencePiece tokenizer that prefixes only the
text's first word with a space), prompts are encoded whole, as before.

Bounds: MAX_TOKENS token ids in all (4 bytes each), least recently used first out; a stretch longer than that is
encoded and not kept. Thread-safe: the tokenizer lanes (service/tokenizer_threads.py) share one, each encoding with
its own tokenizer.
"""
from __future__ import annotations

import hashlib
import re
import threading
import weakref
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MIN_CHARS = 2048          # shorter stretches are encoded each time (~0.5 ms): not worth a lookup
MAX_TOKENS = 1 << 21      # token ids kept in all: 8 MiB


@dataclass(frozen=True)
class Cut:
    """How one tokenizer's text is cut: the added tokens' texts (longest first) and their ids."""

    pattern: re.Pattern[str]
    ids: dict[str, int]

    def pieces(self, text: str) -> list[tuple[str, int | None]]:
        """`text` as (plain stretch, None) and (added token's text, its id), in order."""
        out: list[tuple[str, int | None]] = []
        at = 0
        for m in self.pattern.finditer(text):
            if m.start() > at:
                out.append((text[at:m.start()], None))
            out.append((m.group(), self.ids[m.group()]))
            at = m.end()
        if at < len(text):
            out.append((text[at:], None))
        return out


class SegmentTokens:
    def __init__(self, max_tokens: int = MAX_TOKENS, min_chars: int = MIN_CHARS) -> None:
        self.max_tokens = max_tokens
        self.min_chars = min_chars
        self.hits = 0
        self.misses = 0
        self._lock = threading.Lock()
        self._kept: OrderedDict[bytes, array[int]] = OrderedDict()
        self._tokens = 0
        self._cuts: weakref.WeakKeyDictionary[Any, Cut | None] = weakref.WeakKeyDictionary()

    @property
    def tokens(self) -> int:
        """Token ids kept now."""
        return self._tokens

    def encode(self, tokenizer: Any, text: str, salt: str | None) -> list[int]:
        """`tokenizer.encode(text, add_special_tokens=False)`, its long stretches looked up (the module docstring)."""
        if len(text) < self.min_chars:
            return list(tokenizer.encode(text, add_special_tokens=False))
        cut = self.cut(tokenizer)
        if cut is None:
            return list(tokenizer.encode(text, add_special_tokens=False))
        ids: list[int] = []
        for piece, special in cut.pieces(text):
            if special is not None:
                ids.append(special)
            elif len(piece) < self.min_chars:
                ids += tokenizer.encode(piece, add_special_tokens=False)
            else:
                ids += self._stretch(tokenizer, piece, salt)
        return ids

    def cut(self, tokenizer: Any) -> Cut | None:
        """The tokenizer's cut, if cutting gives its own ids (checked on its first use), else None."""
        with self._lock:
            if tokenizer in self._cuts:
                return self._cuts[tokenizer]
        cut = _checked_cut(tokenizer)
        with self._lock:
            self._cuts[tokenizer] = cut
        return cut

    def _stretch(self, tokenizer: Any, piece: str, salt: str | None) -> array[int]:
        key = hashlib.blake2b(piece.encode("utf-8", "surrogatepass"), digest_size=16,
                              key=hashlib.blake2b((salt or "").encode(), digest_size=32).digest()).digest()
        with self._lock:
            kept = self._kept.get(key)
            if kept is not None:
                self._kept.move_to_end(key)
                self.hits += 1
                return kept
            self.misses += 1
        ids = array("i", tokenizer.encode(piece, add_special_tokens=False))
        if len(ids) > self.max_tokens:
            return ids
        with self._lock:
            if key not in self._kept:
                self._kept[key] = ids
                self._tokens += len(ids)
                while self._tokens > self.max_tokens:
                    _, old = self._kept.popitem(last=False)
                    self._tokens -= len(old)
        return ids


def _checked_cut(tokenizer: Any) -> Cut | None:
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    ids = {str(t.content): int(i) for i, t in decoder.items() if str(t.content)}
    if not ids:
        return None
    texts = sorted(ids, key=len, reverse=True)
    cut = Cut(re.compile("|".join(re.escape(t) for t in texts)), ids)
    specials = [str(t.content) for t in decoder.values() if getattr(t, "special", False)][:32]
    probes = ["Plain text,  two spaces\n\nand lines \n", " leading space", "\n\nleading lines"]
    for s in specials:
        probes += [f"a {s} b", f"a{s}b", f"a\n{s}\nb", f" {s} ", f"{s}\n x", f"x \n{s}", f"{s}{s} {s}"]
    try:
        probes.append(str(tokenizer.apply_chat_template(
            [{"role": "system", "content": " You are\n a helper. "}, {"role": "user", "content": "\nHi  there \n"}],
            tokenize=False, add_generation_prompt=True)))
    except Exception:       # no chat template: the raw probes decide
        pass
    for probe in probes:
        whole = list(tokenizer.encode(probe, add_special_tokens=False))
        parts: list[int] = []
        for piece, special in cut.pieces(probe):
            parts += [special] if special is not None else tokenizer.encode(piece, add_special_tokens=False)
        if parts != whole:
            return None
    return cut


__all__ = ["MAX_TOKENS", "MIN_CHARS", "Cut", "SegmentTokens"]
