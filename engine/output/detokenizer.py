"""Incremental detokenization with stop strings; never emits a broken UTF-8 character.

Token ids become text through a sliding window (the prefix_offset / read_offset method of TGI and vLLM):

    ids:  ... | emitted, decoded again for context | not yet emitted |
                ^ prefix_offset                      ^ read_offset     ^ end

    delta = decode(ids[prefix_offset:])[len(decode(ids[prefix_offset:read_offset])):]

Decoding a few earlier tokens together with the new ones lets the tokenizer see merges and leading
spaces the way a full decode would. When the window's text ends in U+FFFD, the last token stopped in the
middle of a character; nothing is emitted and the offsets stay put until a later token completes it.
The window spans the last emitted chunk plus the held tokens, so a token costs O(window), not
O(output length). (It only grows while tokens keep producing no complete text: a run of skipped special
tokens or of invalid bytes.)

The first window starts with the last prompt tokens (as in vLLM), so a SentencePiece tokenizer gives the
first output token its leading space; for those tokenizers the stream may then differ from
decode(output_ids) alone by that space. Byte-level BPE tokenizers decode the same either way.

Stop strings are searched in `_pending`, the decoded text not yet handed out. `_pending` keeps the
longest suffix that is a prefix of some stop string (at most max_stop_len - 1 characters); everything
before it is safe to emit. A match can therefore never start inside text that was already emitted, and
searching `_pending` alone finds every match, including ones that span several tokens.
"""
from __future__ import annotations

from typing import Any

# Prompt tokens decoded in front of the first output token, for context (vLLM uses the same 5).
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True, include_stop: bool = False) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = list(stop)
        self._include_stop = include_stop      # a match keeps the stop string itself, cuts what follows
        self._max_held = max((len(s) for s in self._stop), default=1) - 1
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        if self._decode(0, self._read_offset).endswith(_REPLACEMENT):
            # The prompt ends mid-character: decode the output on its own rather than let a prompt
            # byte and an output byte merge into one character that belongs to neither text.
            self._ids, self._read_offset = [], 0
        self._emitted: list[str] = []
        self._pending = ""
        self.stop_reason: str | None = None     # the matched stop string, once matched

    @property
    def finished(self) -> bool:
        """True once a stop string matched; later updates are ignored."""
        return self.stop_reason is not None

    @property
    def text(self) -> str:
        """All output text so far: emitted plus held back, cut before a matched stop string.
        Tokens held for an incomplete character are not included until it completes (or `flush`)."""
        return "".join(self._emitted) + self._pending

    def update(self, new_token_ids: list[int]) -> tuple[str, str | None]:
        """Append tokens; return (text now safe to emit, the stop string matched or None).
        Tokens are taken one at a time, so a stop string is caught at the token that completes it;
        tokens after the match are dropped."""
        if self.finished:
            return "", None
        delta: list[str] = []
        for token_id in new_token_ids:
            self._ids.append(token_id)
            delta.append(self._step())
            if self.finished:
                break
        return "".join(delta), self.stop_reason

    def flush(self) -> str:
        """Finish for a reason other than a stop string (length, EOS, abort): return all held text.

        Tokens still held for an incomplete character are decoded as the tokenizer decodes them then,
        U+FFFD included, so the concatenated deltas equal the full decode of the output. Stop strings are
        still honoured: text from a stop string on is never returned."""
        if self.finished:
            return ""
        if self._read_offset < len(self._ids):
            self._pending += self._new_text(self._decode(self._prefix_offset, len(self._ids)))
            self._prefix_offset = self._read_offset = len(self._ids)
            self._match_stop()
        return self._take(len(self._pending))

    # -- internals --------------------------------------------------------------------------------

    def _step(self) -> str:
        # One token was appended to _ids; returns the text it makes safe to emit.
        window_text = self._decode(self._prefix_offset, len(self._ids))
        new = self._new_text(window_text)
        if window_text.endswith(_REPLACEMENT) or not new:
            # Mid-character (or no visible text, e.g. a skipped special token): hold the tokens. Text
            # before the trailing U+FFFD run is final, so a stop string that ends there still counts.
            complete = new.rstrip(_REPLACEMENT)
            if complete and self._stop and self._match_stop(self._pending + complete):
                return self._take(len(self._pending))
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        self._pending += new
        if self._match_stop():
            return self._take(len(self._pending))
        return self._take(len(self._pending) - self._held_suffix_len())

    def _decode(self, start: int, end: int) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special_tokens)

    def _new_text(self, window_text: str) -> str:
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        return window_text[len(prefix_text):]

    def _match_stop(self, text: str | None = None) -> bool:
        """Look for stop strings in `text` (default `_pending`); on a match, cut `_pending` right before
        it (right after it with `include_stop`) and record it. The match that ends first wins, as if text
        arrived one character at a time, so the result does not depend on how tokens split the text; on a
        tie the earlier start wins."""
        text = self._pending if text is None else text
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            at = text.find(stop)
            if at >= 0 and (best is None or (at + len(stop), at) < best[:2]):
                best = (at + len(stop), at, stop)
        if best is None:
            return False
        self._pending = text[:best[0] if self._include_stop else best[1]]
        self.stop_reason = best[2]
        return True

    def _held_suffix_len(self) -> int:
        """Length of the longest suffix of `_pending` that is a proper prefix of some stop string."""
        for length in range(min(len(self._pending), self._max_held), 0, -1):
            tail = self._pending[-length:]
            if any(stop.startswith(tail) for stop in self._stop):
                return length
        return 0

    def _take(self, count: int) -> str:
        out, self._pending = self._pending[:count], self._pending[count:]
        if out:
            self._emitted.append(out)
        return out
