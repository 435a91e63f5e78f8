"""The pin state machine: one implementation of "compute this prefix and pin its full blocks", used by the
offline API and the async engine alike.

    start ──► PINNED                 every full block already cached: pinned at once
      │
      ├────► COMPUTING ──► PINNED    a prefill-only request computes the missing blocks, then they are pinned
      │            └─────► FAILED    the computation was aborted, could not fit, or the cap filled meanwhile
      └────► FAILED                  over the pinned-block cap, prefix caching off, or a bad prompt

Ownership: a job's pins belong to the job until its starter calls `release(job_id, keep=True)`, which
hands them over (they are then undone with `unpin(token_ids)`); `release(job_id, keep=False)` undoes
whatever the job did (aborts its computation, or unpins). So a starter that goes away at any point
(a cancelled HTTP handler) releases with keep=False and nothing stays pinned. A pin is all or nothing:
over the cap, no block is pinned.

NOTE: runs on the thread that owns the core. The prefix is hashed once per job.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.core import EngineCore
from engine.errors import CapacityExceeded, EngineError, InvalidRequest, PinCapExceeded
from engine.kv.block_pool import Block, BlockHash, CacheSalt, PinCapError
from engine.outputs import PinnedPrefix
from engine.sequence import SamplingParams, SequenceGroup


class PinState(enum.Enum):
    COMPUTING = "computing"
    PINNED = "pinned"
    FAILED = "failed"


@dataclass
class PinJob:
    job_id: str
    token_ids: list[int]
    salt: CacheSalt = ()
    hashes: list[BlockHash] = field(default_factory=list)
    state: PinState = PinState.COMPUTING
    request_id: str | None = None          # the prefill computing it, while COMPUTING
    result: PinnedPrefix | None = None
    error: EngineError | None = None

    @property
    def settled(self) -> bool:
        return self.state is not PinState.COMPUTING


class PinStateMachine:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.jobs: dict[str, PinJob] = {}
        self._by_request: dict[str, PinJob] = {}

    def start(self, job_id: str, token_ids: list[int], salt: CacheSalt = ()) -> PinJob:
        """`salt`: what the prefix's hashes mix in (block_pool.CacheSalt); requests hit it only with the same."""
        assert job_id not in self.jobs, f"pin job {job_id!r} exists"
        job = PinJob(job_id, list(token_ids), tuple(salt))
        self.jobs[job_id] = job
        core = self.core
        try:
            if not core.config.enable_prefix_caching:
                raise InvalidRequest("pinning a prefix needs prefix caching, which is disabled", param="prompt")
            job.hashes = core.manager.block_hashes(job.token_ids, salt=job.salt)
            blocks = core.manager.cached_blocks(job.token_ids, job.hashes)
            pool = core.pool
            new = sum(1 for b in blocks if b is None or b.pin_count == 0)
            if pool.num_pinned + new > pool.max_pinned_blocks:
                raise PinCapExceeded(
                    f"pinning this prefix needs {new} more KV blocks, over the cap of {pool.max_pinned_blocks} "
                    f"pinned blocks ({pool.num_pinned} already pinned); nothing was pinned", param="prompt")
            if all(b is not None for b in blocks):
                self._pin(job, blocks)          # type: ignore[arg-type]
                return job
            request = core.make_request(f"pin-{job_id}", job.token_ids,
                                        SamplingParams(max_tokens=0, temperature=0.0, cache_salt=job.salt))
            core.add(request)
            job.request_id = request.request_id
            self._by_request[request.request_id] = job
        except EngineError as exc:
            job.state, job.error = PinState.FAILED, exc
        return job

    def owns(self, request_id: str) -> bool:
        return request_id in self._by_request

    def on_request_end(self, group: SequenceGroup) -> None:
        """The prefill of a COMPUTING job ended: pin its blocks, or fail."""
        job = self._by_request.pop(group.request_id)
        job.request_id = None
        if group.error is not None:
            error = group.error
            if isinstance(error, CapacityExceeded):
                error = PinCapExceeded(error.message, param="prompt")
            job.state, job.error = PinState.FAILED, error
            return
        if group.first.finish_reason == "abort":
            job.state = PinState.FAILED
            job.error = EngineError("the prefix computation was aborted; nothing was pinned")
            return
        blocks = self.core.manager.cached_blocks(job.token_ids, job.hashes)
        # NOTE: the prefill's blocks were freed (kept cached) in this same step; nothing allocates
        # between that and here, so none can have been evicted.
        assert all(b is not None for b in blocks), "a just-computed prefix lost a block"
        try:
            self._pin(job, blocks)              # type: ignore[arg-type]
        except PinCapError as exc:              # other pins took the room while this one computed
            job.state, job.error = PinState.FAILED, PinCapExceeded(str(exc), param="prompt")

    def _pin(self, job: PinJob, blocks: list[Block]) -> None:
        self.core.pool.pin(blocks)
        if self.core.tier is not None:
            self.core.tier.persist(blocks)      # a restart (or another replica) restores it from there
        job.state = PinState.PINNED
        job.result = PinnedPrefix(len(job.token_ids), len(blocks), [h.hex() for h in job.hashes])

    def release(self, job_id: str, keep: bool) -> None:
        """The starter is done with the job: keep its pins (they are the starter's now) or undo it."""
        job = self.jobs.pop(job_id, None)
        if job is None or keep and job.state is PinState.PINNED:
            return
        if job.state is PinState.COMPUTING and job.request_id is not None:
            self._by_request.pop(job.request_id, None)
            self.core.abort(job.request_id)
        elif job.state is PinState.PINNED:
            blocks = self.core.manager.cached_blocks(job.token_ids, job.hashes)
            self.core.pool.unpin(blocks)        # type: ignore[arg-type]

    def unpin(self, token_ids: list[int], salt: CacheSalt = (), forget: bool = False) -> int:
        """Drops one pin from each full block of a prefix pinned before; 0 (nothing done) if it is not.
        `forget` (a deleted prefix): the blocks no other pin holds leave the KV tier, and the cache too where
        no request uses them, so that a deleted prompt does not stay on disk."""
        blocks = self.core.manager.cached_blocks(token_ids, salt=salt)
        if any(b is None or b.pin_count == 0 for b in blocks):
            return 0
        self.core.pool.unpin(blocks)            # type: ignore[arg-type]
        tier = self.core.tier
        if forget and tier is not None:
            loose = [b for b in blocks if b is not None and b.pin_count == 0]
            tier.discard([b.block_hash for b in loose if b.block_hash is not None])
            self.core.pool.forget(loose)
        return len(blocks)
