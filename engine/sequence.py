"""SamplingParams, a checked EngineRequest, and the per-request state the scheduler moves around
(Sequence, SequenceGroup). Outputs handed back live in engine/outputs.py."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.errors import EngineError, InvalidRequest

if TYPE_CHECKING:
    import torch

    from engine.outputs import RequestTimes
    from engine.sample.structured import StructuredSpec
    from engine.sched.beam_search import BeamSearch


GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True)
class Range:
    """A numeric field's allowed values: [lo, hi], `open_lo` making it (lo, hi]; None: unbounded."""

    lo: float | None = None
    hi: float | None = None
    open_lo: bool = False

    def __contains__(self, value: object) -> bool:
        if isinstance(value, bool) or not isinstance(value, int | float):
            return False
        if self.lo is not None and (value <= self.lo if self.open_lo else value < self.lo):
            return False
        return self.hi is None or value <= self.hi

    def describe(self) -> str:
        lo, hi = _num(self.lo), _num(self.hi)
        if self.hi is None:
            return f"{'>' if self.open_lo else '>='} {lo}" if self.lo is not None else "any number"
        return f"within {'(' if self.open_lo else '['}{lo}, {hi}]"


def _num(x: float | None) -> str:
    return str(int(x)) if x is not None and float(x).is_integer() else f"{x}"


# NOTE: one table for both layers: SamplingParams checks these, and the service's request schema
# (service/openai/schema.py) builds its field constraints (and /openapi.json) from the same entries.
MAX_LOGPROBS = 20
MAX_BEST_OF = 64
SAMPLING_RANGES: dict[str, Range] = {
    "n": Range(1, MAX_BEST_OF),
    "best_of": Range(1, MAX_BEST_OF),
    "temperature": Range(0.0, 100.0),
    "top_p": Range(0.0, 1.0, open_lo=True),
    "top_k": Range(-1),                         # -1 or 0: off
    "min_p": Range(0.0, 1.0),
    "seed": Range(-(2**63), 2**64 - 1),         # taken mod 2**64 (engine/sample/sampler.make_generator)
    "max_tokens": Range(0),
    "min_tokens": Range(0),
    "logprobs": Range(0, MAX_LOGPROBS),
    "prompt_logprobs": Range(0, MAX_LOGPROBS),
    "presence_penalty": Range(-2.0, 2.0),
    "frequency_penalty": Range(-2.0, 2.0),
    "repetition_penalty": Range(0.0, 10.0, open_lo=True),
    "length_penalty": Range(-10.0, 10.0),
    "logit_bias": Range(-100.0, 100.0),         # each bias
}
_INTEGER = ("n", "best_of", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs")


@dataclass
class SamplingParams:
    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1                     # -1 or 0: off
    seed: int | None = None
    max_tokens: int | None = 16         # None: up to max_model_len
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None         # top-k log-probabilities per sampled token
    prompt_logprobs: int | None = None  # top-k log-probabilities per prompt token (the prompt is computed whole)
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | str = False  # True | False | "never" (transformers' meanings)
    presence_penalty: float = 0.0       # engine/sample/logits_processors.py has the semantics of these five
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    min_tokens: int = 0
    min_p: float = 0.0                  # keep tokens with probability >= min_p * the top token's
    structured: StructuredSpec | None = None   # constrained decoding (engine/sample/structured.py)
    skip_special_tokens: bool = True    # special tokens (EOS, template markers) left out of the text
    include_stop_str_in_output: bool = False   # the matched stop string ends the text instead of being cut
    # Not sampling, but carried to every sequence of the request like the rest: what its KV blocks' hashes
    # mix in (engine/kv/block_pool.CacheSalt), set by the service from the caller, never from the body.
    cache_salt: tuple[tuple[int, str], ...] = ()

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in self.stop]
        if self.best_of is None:
            self.best_of = self.n
        checks: list[tuple[bool, str, str]] = []
        for name, allowed in SAMPLING_RANGES.items():
            value = getattr(self, name)
            if name == "logit_bias":
                ok = value is None or all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 and b in allowed
                                          for t, b in value.items())
                checks.append((ok, name, f"logit_bias maps token ids to biases {allowed.describe()}"))
                continue
            kind = "an integer " if name in _INTEGER else ""
            ok = value is None or (value in allowed and (name not in _INTEGER or isinstance(value, int)))
            checks.append((ok, name, f"{name} must be {kind}{allowed.describe()}"))
        checks += [
            (self.best_of is None or self.best_of >= self.n, "best_of", "best_of must be >= n"),
            (all(isinstance(s, str) and s for s in self.stop), "stop", "stop must be non-empty strings"),
            (all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids",
             "stop_token_ids must be non-negative integers"),
            (self.prompt_logprobs is None or not self.use_beam_search, "prompt_logprobs",
             "prompt log-probabilities are not reported for beam search"),
            (not self.use_beam_search or (self.top_p == 1.0 and self.top_k in (-1, 0)), "use_beam_search",
             "beam search is deterministic: top_p and top_k cannot be set with it"),
            (self.early_stopping in (True, False, "never"), "early_stopping",
             "early_stopping must be true, false or \"never\""),
            (self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
             "min_tokens must be <= max_tokens"),
            (self.structured is None or not self.use_beam_search,
             self.structured.param if self.structured else "use_beam_search",
             "structured output is not supported with beam search"),
        ]
        for ok, param, message in checks:
            if not ok:
                raise InvalidRequest(message, param=param)

    @property
    def greedy(self) -> bool:
        """Argmax decoding. NOTE: a temperature below 1e-5 counts as 0 (vLLM's threshold): dividing
        float32 logits by 1e-40 or 1e-300 would overflow them to inf and NaN."""
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class EngineRequest:
    """A request that passed the checks on fixed inputs (`EngineCore.make_request`): what the engine
    thread admits, or refuses if the cache cannot hold it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int                     # resolved: never None
    arrival: float                      # time.monotonic() when made
    grammar: Any = None                 # structured output: its compiled grammar, once compiled (AsyncEngine)
    tenant: str = ""                    # whose it is: an opaque key the scheduler is fair between (sched/queues.py)


class Sequence:
    """One generated sequence's runtime state (prompt + output tokens and how much is computed).

    Token regions:   | computed (KV in cache) | not yet computed |
                     0                num_computed        len(token_ids)
    After preemption by recompute, num_computed drops to 0 and the whole list is recomputed.
    """

    def __init__(self, seq_id: int, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 arrival: float, max_tokens: int) -> None:
        self.seq_id = seq_id
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.token_ids = list(prompt_token_ids)
        self.params = params
        self.arrival = arrival
        self.max_tokens = max_tokens          # resolved: never None
        self.status = Status.WAITING
        self.num_computed = 0
        self.num_cached_tokens = -1           # prefix-cache hit at first admission; -1 until admitted
        self.num_written_tokens = 0           # prompt tokens whose blocks it was the first to cache
        self.block_hashes: list[Any] = []     # full-block hashes of token_ids (BlockHash), grown lazily
        self.tier_load: Any = None            # the KV tier's load it waits for (engine/kv/tier), if any
        self.tier_checked = False             # the KV tier was asked for its prompt since it last waited
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.cumulative_logprob = 0.0
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None
        # per prompt token (None for the first, which nothing predicts); filled while the prompt computes
        self.prompt_logprobs: list[dict[int, float] | None] | None = (
            [None] if params.prompt_logprobs is not None else None)
        self.group: SequenceGroup | None = None
        self.index = 0                        # output index within its request
        self.pending_logprobs: torch.Tensor | None = None  # beam search: next-token log-probs awaiting siblings
        self.generator: torch.Generator | None = None            # set by the engine
        self.guide: Any = None                # structured output: its grammar matcher, from its first sample
        self.tenant = ""                      # its request's tenant (EngineRequest.tenant): an opaque key

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, req={self.request_id!r}, tokens={self.num_tokens}, "
                f"computed={self.num_computed}, {self.status.value})")


class SequenceGroup:
    """One request: its sequences (several for n > 1, best_of or beam search) and how they are combined.

    Parallel sampling: the prompt is computed once by sequence 0; when its prefill ends, best_of - 1
    children fork from it, sharing every block by reference count. Beam search: the live beams are the
    group's running sequences; `beam` holds the search state (engine/sched/beam_search.py).
    """

    def __init__(self, request: EngineRequest, first: Sequence, times: RequestTimes) -> None:
        self.request_id = request.request_id
        self.params = request.params
        self.max_tokens = request.max_tokens
        self.prompt_token_ids = request.prompt_token_ids
        self.first = first                    # sequence 0: computes the prompt, knows its cache hit
        self.seqs: list[Sequence] = [first]   # every sequence ever in the group (beams: the live ones)
        self.forked = False
        self.beam: BeamSearch | None = None   # set when params.use_beam_search
        self.ended = False                    # aborted or failed: finished whatever its sequences say
        self.error: EngineError | None = None  # why the engine ended it, when it did
        self.grammar: Any = None              # structured output: the compiled grammar its sequences match
        self.times = times
        self.num_generated_tokens = 0         # tokens sampled for any of its sequences
        first.group = self

    @property
    def best_of(self) -> int:
        return self.params.best_of or self.params.n

    @property
    def streams(self) -> bool:
        """Deltas flow as they come only when every sequence is returned as it is generated."""
        return not self.params.use_beam_search and self.best_of == self.params.n

    @property
    def finished(self) -> bool:
        if self.ended:
            return True
        if self.beam is not None:
            return self.beam.done
        return all(s.finished for s in self.seqs) and (self.forked or self.best_of == 1)
