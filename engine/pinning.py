"""The pin state machine: one implementation of "compute this prefix and pin its full blocks", used by the
offline API and the async engine alike.

    start ──► PINNED                 every full block already cached: pinned at once
      │
      ├────► COMPUTING ──► PINNED    a prefill-only request computes the missing blocks, then they are pinned
      │            └─────► FAILED    the computation was aborted, could not fit, or the cap filled meanwhile
      └────► FAILED                  over the pinned-block cap, prefix caching off, or a bad prompt

Ownership: a job's pins belong to the job until its starter calls `release(job_id, keep=True)`, which
hands them over (they are then undone with `unpin(token_ids, salt, tenant)`); `release(job_id, keep=False)` undoes
whatever the job did (aborts its computation, or unpins). So a starter that goes away at any point
(a cancelled HTTP handler) releases with keep=False and nothing stays pinned. A pin is all or nothing:
over the cap, or over its tenant's share of the cap (`pinned_tenant_fraction`; a job with a tenant key), no
block is pinned.

NOTE: runs on the thread that owns the core. The prefix is hashed once per job.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from engine.core import EngineCore
from engine.errors import CapacityExceeded, EngineError, InvalidRequest, PinCapExceeded
from engine.kv.block_pool import Block, BlockHash, CacheSalt, PinCapError, PinShareError
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
    tenant: str = ""                       # whose pin it is: an opaque key, held to its share ("": the cap only)
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

    def start(self, job_id: str, token_ids: list[int], salt: CacheSalt = (), tenant: str = "") -> PinJob:
        """`salt`: what the prefix's hashes mix in (block_pool.CacheSalt); requests hit it only with the same.
        `tenant`: whose pin it is (its computation is scheduled as that tenant's, and it counts in its share)."""
        assert job_id not in self.jobs, f"pin job {job_id!r} exists"
        job = PinJob(job_id, list(token_ids), tuple(salt), tenant)
        self.jobs[job_id] = job
        core = self.core
        try:
            if not core.config.enable_prefix_caching:
                raise InvalidRequest("pinning a prefix needs prefix caching, which is disabled", param="prompt")
            job.hashes = core.manager.block_hashes(job.token_ids, salt=job.salt)
            blocks = core.manager.cached_blocks(job.token_ids, job.hashes)
            pool = core.pool
            new, mine = pool.new_pins(blocks, tenant)
            if pool.num_pinned + new > pool.max_pinned_blocks:
                raise PinCapExceeded(
                    f"pinning this prefix needs {new} more KV blocks, over the cap of {pool.max_pinned_blocks} "
                    f"pinned blocks ({pool.num_pinned} already pinned); nothing was pinned", param="prompt")
            held = pool.pinned_by.get(tenant, 0)
            if tenant and held + mine > pool.max_pinned_per_owner:
                raise PinCapExceeded(self._share_message(mine, held), param="prompt")
            if all(b is not None for b in blocks):
                self._pin(job, blocks)          # type: ignore[arg-type]
                return job
            request = core.make_request(f"pin-{job_id}", job.token_ids,
                                        SamplingParams(max_tokens=0, temperature=0.0, cache_salt=job.salt), tenant)
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
        except PinShareError:                   # its tenant's other pins took its share while it computed
            pool = self.core.pool
            _, mine = pool.new_pins(blocks, job.tenant)
            job.state = PinState.FAILED
            job.error = PinCapExceeded(self._share_message(mine, pool.pinned_by.get(job.tenant, 0)), param="prompt")
        except PinCapError as exc:              # other pins took the room while this one computed
            job.state, job.error = PinState.FAILED, PinCapExceeded(str(exc), param="prompt")

    def _share_message(self, more: int, held: int) -> str:
        pool, fraction = self.core.pool, self.core.config.pinned_tenant_fraction
        return (f"pinning this prefix needs {more} more KV blocks, over this tenant's share of "
                f"{pool.max_pinned_per_owner} pinned blocks ({held} pinned by its prefixes and leases already; "
                f"the share is --pinned-tenant-fraction {fraction:g} of the cap of {pool.max_pinned_blocks}); "
                "nothing was pinned: delete one of its prefixes first")

    def _pin(self, job: PinJob, blocks: list[Block]) -> None:
        self.core.pool.pin(blocks, job.tenant)
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
            self.core.pool.unpin(blocks, job.tenant)    # type: ignore[arg-type]

    def unpin(self, token_ids: list[int], salt: CacheSalt = (), tenant: str = "", forget: bool = False) -> int:
        """Drops one pin (of `tenant`, as it was pinned) from each full block of a prefix pinned before; 0
        (nothing done) if it is not. `forget` (a deleted prefix): the blocks no other pin holds leave the KV
        tier, and the cache too where no request uses them, so that a deleted prompt does not stay on disk."""
        blocks = self.core.manager.cached_blocks(token_ids, salt=salt)
        if any(b is None or b.pin_count == 0 or tenant and not (b.pinners and b.pinners.get(tenant))
               for b in blocks):
            return 0
        self.core.pool.unpin(blocks, tenant)    # type: ignore[arg-type]
        tier = self.core.tier
        if forget and tier is not None:
            loose = [b for b in blocks if b is not None and b.pin_count == 0]
            tier.discard([b.block_hash for b in loose if b.block_hash is not None])
            self.core.pool.forget(loose)
        return len(blocks)
