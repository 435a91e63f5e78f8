"""LLMEngine: the synchronous engine, three parts behind one face.

    EngineCore       (core.py)             tokens: schedule, run the model, sample, token-level stops, forks
    OutputProcessor  (output/processor.py) text: detokenize, stop strings, n best; RequestOutputs
    PinStateMachine  (pinning.py)          prefixes: compute and pin, release, unpin

`step()` runs one core step, settles the pins whose computation ended, and returns the outputs of every
request that progressed. The offline API (llm.py) and the async engine (async_engine.py) both drive
this class, from one thread at a time.
"""
from __future__ import annotations

import itertools

from engine.config import EngineConfig
from engine.core import EngineCore
from engine.errors import EngineError
from engine.kv.block_pool import CacheSalt
from engine.models.loader import LoadedModel
from engine.output.processor import OutputProcessor
from engine.outputs import EngineStats, PinnedPrefix, RequestOutput
from engine.pinning import PinJob, PinStateMachine
from engine.sequence import EngineRequest, SamplingParams, SequenceGroup


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        self.config = config
        self.core = EngineCore(config, loaded)
        self.loaded = self.core.loaded
        self.tokenizer = self.loaded.tokenizer
        self.fingerprint = self.loaded.fingerprint
        self.max_model_len = self.core.max_model_len
        self.output = OutputProcessor(self.core, self.tokenizer)
        self.pins = PinStateMachine(self.core)
        self._stash: list[RequestOutput] = []       # outputs of steps run inside pin_prefix
        self._pin_ids = itertools.count()

    # -- requests -----------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    tenant: str = "") -> SequenceGroup:
        return self.add(self.core.make_request(request_id, prompt_token_ids, params, tenant))

    def add(self, request: EngineRequest) -> SequenceGroup:
        """Admits a request checked by `core.make_request`. Raises InvalidRequest or QueueFull."""
        group = self.core.add(request)
        self.output.add(group)
        return group

    def abort(self, request_id: str, error: EngineError | None = None) -> RequestOutput | None:
        """Ends a request (its blocks are freed now); its last output, or None if it is not running."""
        group = self.core.abort(request_id, error)
        if group is None:
            return None
        if self.pins.owns(request_id):
            self.pins.on_request_end(group)
            return None
        return self.output.aborted(group)

    def has_unfinished(self) -> bool:
        return self.core.has_unfinished()

    @property
    def request_ids(self) -> list[str]:
        return list(self.core.requests)

    def step(self) -> list[RequestOutput]:
        stashed, self._stash = self._stash, []
        out = self.core.step()
        for group in out.groups:
            if group.finished and self.pins.owns(group.request_id):
                self.pins.on_request_end(group)
        return stashed + self.output.process(out)

    # -- prefixes -----------------------------------------------------------------------------
    def start_pin(self, job_id: str, token_ids: list[int], salt: CacheSalt = (), tenant: str = "") -> PinJob:
        return self.pins.start(job_id, token_ids, salt, tenant)

    def release_pin(self, job_id: str, keep: bool) -> None:
        self.pins.release(job_id, keep)

    def pin_prefix(self, token_ids: list[int], salt: CacheSalt = (), tenant: str = "") -> PinnedPrefix:
        """Computes the prefix's KV (prefix-cache hits are reused) and pins its full blocks; steps the
        engine until then (other requests' outputs of those steps come with the next `step()`).
        Raises PinCapExceeded (nothing pinned) or InvalidRequest."""
        job = self.start_pin(f"sync-{next(self._pin_ids)}", token_ids, salt, tenant)
        while not job.settled:
            self._stash.extend(self.step())
        self.release_pin(job.job_id, keep=True)
        if job.error is not None:
            raise job.error
        assert job.result is not None
        return job.result

    def unpin_prefix(self, token_ids: list[int], salt: CacheSalt = (), tenant: str = "", forget: bool = False) -> int:
        """`forget`: the prefix was deleted: its blocks also leave the KV tier (pinning.PinStateMachine.unpin)."""
        return self.pins.unpin(token_ids, salt, tenant, forget)

    def stats(self) -> EngineStats:
        return self.core.stats()
