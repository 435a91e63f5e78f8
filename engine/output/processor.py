"""OutputProcessor: from the core's tokens to what a caller receives.

Owns, per request: the incremental detokenizer of each sequence, the stop-string check (a match ends
the sequence through `EngineCore.finish_seq`), and the shape of the outputs:
- streaming requests (every sequence returned as generated: n == best_of, no beam search) get one delta
  per step in which they progressed; the last has `finished` set;
- the others (best_of > n, beam search) get nothing until they end, then the n best, whole.

A failure while processing one request (a tokenizer that raises, say) ends that request with an error;
the other requests of the step go on.

NOTE: runs on the thread that owns the core, right after `EngineCore.step`, so a stop string frees its
sequence's blocks before the next step is scheduled.
"""
from __future__ import annotations

import logging
from typing import Any

from engine.core import CoreOutput, EngineCore
from engine.errors import EngineError
from engine.output.detokenizer import IncrementalDetokenizer
from engine.outputs import CompletionOutput, RequestOutput
from engine.sequence import Sequence, SequenceGroup

log = logging.getLogger(__name__)


class _RequestText:
    """The detokenizers of one request's sequences, made on each sequence's first token."""

    def __init__(self, tokenizer: Any, group: SequenceGroup) -> None:
        self.tokenizer = tokenizer
        self.group = group
        self.detoks: dict[int, IncrementalDetokenizer] = {}    # seq_id -> its detokenizer
        self.told_finished: set[int] = set()                   # output indices whose finish went out

    def of(self, seq: Sequence) -> IncrementalDetokenizer:
        detok = self.detoks.get(seq.seq_id)
        if detok is None:
            p = seq.params
            detok = IncrementalDetokenizer(self.tokenizer, seq.prompt_token_ids, p.stop, p.skip_special_tokens,
                                           p.include_stop_str_in_output)
            self.detoks[seq.seq_id] = detok
        return detok

    def text(self, seq: Sequence) -> str:
        detok = self.detoks.get(seq.seq_id)
        return detok.text if detok is not None else ""


class OutputProcessor:
    def __init__(self, core: EngineCore, tokenizer: Any) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self._requests: dict[str, _RequestText] = {}

    def add(self, group: SequenceGroup) -> None:
        self._requests[group.request_id] = _RequestText(self.tokenizer, group)

    def owns(self, request_id: str) -> bool:
        return request_id in self._requests

    def process(self, out: CoreOutput) -> list[RequestOutput]:
        deltas: dict[str, list[CompletionOutput]] = {}
        for seq in out.sampled:
            state = self._requests.get(seq.request_id)
            if state is None:
                continue
            try:
                deltas.setdefault(seq.request_id, []).append(self._token(state, seq))
            except Exception as exc:  # this request only: the rest of the step goes on
                self._fail(seq.request_id, exc)
        results = []
        for group in out.groups:
            rid = group.request_id
            if rid not in self._requests:
                continue
            try:
                result = self._output(group, deltas.get(rid, []))
            except Exception as exc:
                self._fail(rid, exc)
                result = self._request_output(group, self._untold(group, self._requests.pop(rid, None), []))
            if result is not None:
                results.append(result)
        return results

    def aborted(self, group: SequenceGroup) -> RequestOutput:
        """The last output of a request the caller (or the engine) ended."""
        state = self._requests.pop(group.request_id, None)
        if group.streams or state is None:
            return self._request_output(group, self._untold(group, state, []))
        return self._request_output(group, self._final(group, state))

    # -- internals ----------------------------------------------------------------------------
    def _token(self, state: _RequestText, seq: Sequence) -> CompletionOutput:
        """Text for the sequence's newest token, and the stop-string check."""
        token = seq.token_ids[-1]
        detok = state.of(seq)
        if seq.finished and seq.finish_reason == "stop":   # a stop token or EOS (core rule): not text
            return self._completion(seq, [token], detok.flush())
        text, stop = detok.update([token])
        if stop is not None:
            self.core.finish_seq(seq, "stop", stop)
            seq.finish_reason, seq.stop_reason = "stop", stop    # overrides "length" on the same token
        elif seq.finished:
            text += detok.flush()
        return self._completion(seq, [token], text)

    def _output(self, group: SequenceGroup, deltas: list[CompletionOutput]) -> RequestOutput | None:
        state = self._requests[group.request_id]
        state.told_finished.update(d.index for d in deltas if d.finish_reason is not None)
        if group.finished:
            del self._requests[group.request_id]
            if not group.streams:
                return self._request_output(group, self._final(group, state))
            return self._request_output(group, self._untold(group, state, deltas))
        if group.streams and deltas:
            return self._request_output(group, deltas)
        return None

    def _untold(self, group: SequenceGroup, state: _RequestText | None,
                deltas: list[CompletionOutput]) -> list[CompletionOutput]:
        """`deltas`, then an empty delta for every sequence that ended without its finish going out (cut
        short by the engine or the caller, or ended before its first token, as max_tokens=0 does)."""
        told = (state.told_finished if state is not None else set()) | {d.index for d in deltas
                                                                          if d.finish_reason is not None}
        return deltas + [self._completion(s, [], "") for s in group.seqs if s.finished and s.index not in told]

    def _final(self, group: SequenceGroup, state: _RequestText) -> list[CompletionOutput]:
        """The n best of a non-streaming request: by cumulative log-probability, or the beam hypotheses."""
        n = group.params.n
        if group.beam is not None:
            eos = group.beam.eos_token_ids
            skip = group.params.skip_special_tokens
            outs = [CompletionOutput(i, self.tokenizer.decode(h.token_ids, skip_special_tokens=skip), h.token_ids,
                                     "stop" if h.token_ids and h.token_ids[-1] in eos else "length",
                                     cumulative_logprob=h.logprob) for i, h in enumerate(group.beam.results(n))]
            return outs or [CompletionOutput(0, "", [], "abort")]     # ended before its first step
        best = sorted(group.seqs, key=lambda s: -s.cumulative_logprob)[:n]
        return [CompletionOutput(i, state.text(s), s.output_token_ids, s.finish_reason, s.stop_reason,
                                 s.cumulative_logprob, s.logprobs) for i, s in enumerate(best)]

    def _completion(self, seq: Sequence, delta_ids: list[int], delta_text: str) -> CompletionOutput:
        return CompletionOutput(
            index=seq.index, text=delta_text, token_ids=delta_ids, finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason, cumulative_logprob=seq.cumulative_logprob,
            logprobs=seq.logprobs[-len(delta_ids):] if seq.logprobs and delta_ids else None)

    def _request_output(self, group: SequenceGroup, outs: list[CompletionOutput]) -> RequestOutput:
        prompt_logprobs = group.first.prompt_logprobs
        if prompt_logprobs is not None and len(prompt_logprobs) < len(group.prompt_token_ids):
            prompt_logprobs = None                   # not all computed yet (a chunked prefill)
        return RequestOutput(group.request_id, group.prompt_token_ids, outs, group.finished,
                             num_cached_tokens=max(group.first.num_cached_tokens, 0),
                             num_written_tokens=group.first.num_written_tokens, error=group.error,
                             times=group.times, num_generated_tokens=group.num_generated_tokens,
                             prompt_logprobs=prompt_logprobs)

    def _fail(self, request_id: str, exc: Exception) -> None:
        log.exception("request %s failed while its output was processed", request_id)
        self.core.abort(request_id, EngineError(f"internal error while processing the output: {exc}"))
