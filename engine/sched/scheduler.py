"""Iteration-level (continuous) batching with chunked prefill and preemption by recompute.

Each step, in this order, under the budgets `max_num_seqs` and `max_num_batched_tokens`:
  1. running decodes (one token each, oldest first). A decode that cannot get a block preempts a victim (its
     blocks freed, requeued at the front of its tenant's queue): the youngest running sequence of the tenant
     that runs the most;
  2. tenants with work waiting and nothing running ("starved"), in turn order: each one's first request is
     admitted, and if the seats or the blocks are short, victims of the other tenants that run two or more
     (as in 1) are preempted for it. So a tenant waits for another tenant's running requests to end only where
     each runs just one;
  3. running sequences still in a chunked prefill, with the tokens left in the budget (a smaller chunk
     when blocks are short; with no block at all, a victim is preempted);
  4. waiting sequences, round-robin between tenants, first come first served within one (engine/sched/
     queues.py): their prompt is looked up in the prefix cache and only the rest is scheduled (a chunk of it
     if the budget is short). Prompt blocks another sequence is computing (in flight) are never computed
     twice: where that sequence's chunk in this very step finishes them, the prompt shares them at once and
     computes only what follows, in the same step (in-step sharing, below); where it does not, the prompt
     waits for them (in-flight dedupe) and lets the next ones go. In a step that carries decodes, new prompts
     come in only up to `decode_prefill_cost` (below), at least one; so also in a step that carries a chunk of a
     prompt under way (phase 3).
In-step sharing: a layer writes the step's K / V into the cache before any of its attention reads it (every
backend's `attend`), so a prompt whose blocks 0..j-1 another sequence writes in this step can attend to them in the
same step: eight requests that arrive together with one cold 1,024-token prefix all have their first tokens from the
step that computes it, instead of one then and the others a step or more later. The blocks are shared by reference
at admission and hashed by their writer's commit; if the step does not run (the KV backend refused it), the sharers
are preempted (`undo_joins`): they would read blocks never written.
The prefill cost cap: a step that carries running decodes (or a chunk of a prompt under way: below) admits new
prompts (phase 4) only while the step's prefill work stays within `decode_prefill_cost` "token equivalents": a chunk
of n tokens after c computed ones costs n (1 + (c + n / 2) w), its projections plus its attention over the context,
w being the model's attention work a context token against its projections' a token (`context_weight`). The first
prompt of a step with no prefill work yet comes in whatever its cost. Without the cap, 16 questions after one long
shared system prompt that arrive together are all prefilled in one step of seconds, so every one of them waits for
all of them, they finish together and the next 16 arrive together again; with it they come in one or two a step
between the decodes, and their successors arrive spread out (README, Scheduling policy, has the measurements). For
the same reason a step that carries a chunk of a prompt under way caps the prompts that share its blocks (in-step
sharing, above): the 15 questions after a cold 3,072-token system prompt, all sharing the step that ends its
computation, got their first tokens ~9% sooner at p90, but ended together, and so did their successors, whose TTFT
p50 came out 2-3x longer (README, Scheduling policy). A step with neither (a prompt admitted whole beside the
prompts that share it, say) still takes the whole `max_num_batched_tokens`.
A sequence samples a token in a step iff that step's chunk reaches its last token. A tenant is an opaque key
on each request (`Sequence.tenant`, "" by default): with one tenant, 2 never preempts and 4 is plain FCFS.

Beam groups move as a unit: a beam search steps only once every live beam has its logits, so a beam left
waiting would hold its running siblings (their seats and blocks) forever. Preempting a beam preempts its
running siblings too, each forgetting the logits it computed; a waiting group is admitted whole or not at
all. A request never has more samples or beams than `max_num_seqs` (refused when made: EngineCore).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from engine.kv.block_manager import BlockManager, PrefixHit
from engine.sched.queues import TenantQueues, pick_victim
from engine.sequence import Sequence, Status

if TYPE_CHECKING:
    from engine.kv.tier.tier import KVTier


@dataclass
class ScheduledSeq:
    seq: Sequence
    num_new: int        # tokens computed this step, starting at seq.num_computed
    sample: bool        # the chunk reaches the sequence's last token


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    failed: list[Sequence] = field(default_factory=list)     # can never fit the cache: finished with an error
    copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write block copies (src, dst)
    joined: list[Sequence] = field(default_factory=list)   # prompts sharing blocks this step writes (in-step sharing)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.scheduled)


def _is_prefill(s: ScheduledSeq) -> bool:
    """Prompt work (a chunk, or a preempted sequence computing its tokens again), not a decode."""
    return s.num_new > 1 or s.seq.num_computed < s.seq.num_prompt_tokens


class Scheduler:
    def __init__(self, manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int,
                 tier: KVTier | None = None, decode_prefill_cost: int = 0, context_weight: float = 0.0) -> None:
        self.manager = manager
        self.tier = tier
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.decode_prefill_cost = decode_prefill_cost      # 0: no cap (the module docstring)
        self.context_weight = context_weight
        self.waiting = TenantQueues()
        self.running: list[Sequence] = []          # kept sorted by arrival (oldest first)
        self.num_preemptions = 0
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.watermark = manager.pool.num_blocks_total // 100

    def add(self, seq: Sequence) -> None:
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def add_running(self, seq: Sequence) -> None:
        """A sequence forked from a running one (its blocks already shared through the block manager)."""
        seq.status = Status.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.arrival)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a finished or aborted sequence out of the queues and free its blocks."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.manager.free(seq.seq_id)
        seq.status = Status.FINISHED

    # -- one step -----------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_ids: set[int] = set()

        # 1. decodes, oldest first; out of blocks -> preempt the youngest not yet scheduled.
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.status is not Status.RUNNING or seq.num_tokens - seq.num_computed != 1:
                continue
            while not self.manager.grow(seq.seq_id, seq.num_computed + 1, write_from=seq.num_computed):
                budget += self._preempt(self._victim_unscheduled(scheduled_ids), out, scheduled_ids)
                if seq.status is not Status.RUNNING:     # it was the victim, or a beam of the victim's group
                    break
            if seq.status is Status.RUNNING:
                out.scheduled.append(ScheduledSeq(seq, 1, True))
                scheduled_ids.add(seq.seq_id)
                budget -= 1

        # 2. starved tenants: their first request, preempting other tenants' sequences for room if need be.
        budget = self._admit_starved(budget, out, scheduled_ids)

        # 3. running sequences in the middle of a chunked prefill.
        chunking = False
        for seq in list(self.running):
            if budget == 0:
                break
            if seq.seq_id in scheduled_ids or seq.status is not Status.RUNNING or seq.num_tokens == seq.num_computed:
                continue  # (a beam whose logits wait for its siblings has nothing to compute)
            num_new = min(seq.num_tokens - seq.num_computed, budget)
            # Short of blocks: a smaller chunk; no room at all: preempt the youngest (maybe this one),
            # or sequences mid-prefill could hold each other's memory forever.
            while (room := self.manager.growable_tokens(seq.seq_id, seq.num_computed) - seq.num_computed) <= 0:
                budget += self._preempt(self._victim_unscheduled(scheduled_ids), out, scheduled_ids)
                if seq.status is not Status.RUNNING:
                    break
            if seq.status is not Status.RUNNING:
                continue
            num_new = min(num_new, room)
            # NOTE: never inside an assert: `python -O` drops asserts, and the blocks with them
            if not self.manager.grow(seq.seq_id, seq.num_computed + num_new, write_from=seq.num_computed):
                raise RuntimeError(f"the block manager refused {num_new} tokens it said it had room for")
            out.scheduled.append(ScheduledSeq(seq, num_new, seq.num_computed + num_new == seq.num_tokens))
            scheduled_ids.add(seq.seq_id)
            budget -= num_new
            chunking = True

        # 4. waiting sequences, round-robin between tenants and FCFS within one: the head of the tenant whose
        #    turn it is blocks the rest (no overtaking), except a sequence whose next uncached prompt block
        #    another running sequence is computing and does not finish in this step (in-flight dedupe): it
        #    waits for that block instead of computing it again, and the ones behind it go first. Not in a step
        #    that had to preempt: memory is short, admitting more would only thrash.
        deferred: set[int] = set()
        if self.tier is not None and self.waiting:
            self.tier.install_finished(self.manager.pool, keep_free=self.watermark)
        # the prefill cost cap (module docstring): only in a step with decodes or a chunk under way, less phases 2
        # and 3's prefill work; a step's first prompt comes in whole
        prefill = [s for s in out.scheduled if _is_prefill(s)]
        prefilling = bool(prefill)
        cost_left = self.decode_prefill_cost - sum(self.prefill_cost(s.seq.num_computed, s.num_new) for s in prefill) \
            if self.decode_prefill_cost and (chunking or len(prefill) < len(out.scheduled)) else None
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            head = self.waiting.next(deferred)
            if head is None:
                break
            seq = head
            unit = self._unit(seq)
            if len(self.running) + len(unit) > self.max_num_seqs:
                break
            cached = self._lookup(seq)
            hit = cached
            if len(unit) == 1:      # tier loads and in-step sharing are for single sequences (a beam group computes)
                shared = None if self._waits_for_tier(seq, cached) else self._inflight_hit(seq, cached, out)
                if shared is None:
                    deferred.add(seq.seq_id)
                    continue
                hit = shared
            if cost_left is not None:
                cost = len(unit) * self.prefill_cost(hit.num_tokens, min(seq.num_tokens - hit.num_tokens, budget))
                if cost > cost_left and prefilling:
                    break                       # the cap is spent (FCFS: nobody overtakes it)
                cost_left -= cost
            took = self._admit_unit(unit, seq, hit, budget, out, scheduled_ids)
            if took is not None:
                if hit is not cached:
                    out.joined.append(seq)
                budget -= took
                prefilling = prefilling or took > 0
                self.waiting.served(seq.tenant)
                continue
            if not self.running and not out.scheduled:
                # Nothing runs that could free blocks: this one can never fit.
                for member in unit:
                    self.waiting.remove(member)
                    self.manager.free(member.seq_id)
                    out.failed.append(member)
                continue
            break

        out.copies = self.manager.pending_copies
        self.manager.pending_copies = []
        return out

    def prefill_cost(self, computed: int, n: int) -> float:
        """A prefill chunk's cost in token equivalents: n tokens after `computed` ones (the module docstring)."""
        return n * (1.0 + (computed + n / 2) * self.context_weight)

    def _admit_starved(self, budget: int, out: SchedulerOutput, scheduled_ids: set[int]) -> int:
        """Phase 2 (the module docstring): each tenant with work waiting and nothing running gets its first
        request admitted now, other tenants' youngest sequences preempted for its seats and blocks if need be.
        Returns the budget left."""
        tenants = self.waiting.tenants()
        if len(tenants) < 2 and not any(s.tenant not in tenants for s in self.running):
            return budget                       # one tenant: nothing to be fair between (phase 4 is FCFS)
        running = {s.tenant for s in self.running}
        for tenant in tenants:
            if budget <= 0:
                break
            if tenant in running:
                continue
            seq = self.waiting.queue(tenant)[0]
            unit = self._unit(seq)
            hit = self._lookup(seq)
            if len(unit) == 1 and self._inflight_hit(seq, hit, out) is not hit:
                continue            # its block is being computed: it is not starved of it (phase 4 shares or waits)
            took: int | None = None
            while True:
                if len(self.running) + len(unit) <= self.max_num_seqs:
                    took = self._admit_unit(unit, seq, hit, budget, out, scheduled_ids)
                    if took is not None:
                        break
                # NOTE: only a tenant running two or more gives one up: one that runs a single sequence keeps it, or
                # two tenants short of room would take each other's seat every step (neither getting anywhere)
                victim = self._victim(scheduled_ids, exclude=tenant, keep_one=True)
                if victim is None:
                    break
                budget += self._preempt(victim, out, scheduled_ids)
            if took is not None:
                budget -= took
                running.add(tenant)
                self.waiting.served(tenant)
        return budget

    def _admit_unit(self, unit: list[Sequence], seq: Sequence, hit: PrefixHit, budget: int, out: SchedulerOutput,
                    scheduled_ids: set[int]) -> int | None:
        """Admits `seq`'s unit whole (a beam group) or not at all; the tokens it scheduled, or None."""
        admitted: list[Sequence] = []
        took = 0
        for member in unit:
            n = self._admit(member, budget - took, out, scheduled_ids, hit if member is seq else None)
            if n is None:
                break
            admitted.append(member)
            took += n
        if len(admitted) == len(unit):
            return took
        for member in reversed(admitted):      # a beam group comes back whole or not at all
            self._unadmit(member, out, scheduled_ids)
        return None

    def _unit(self, seq: Sequence) -> list[Sequence]:
        """What is admitted together with `seq`: the waiting beams of its group (a beam search steps only when
        every live beam has its logits, so a beam left waiting would hold its running siblings forever), else
        `seq` alone."""
        group = seq.group
        if group is None or group.beam is None or len(group.seqs) < 2:
            return [seq]
        return [s for s in self.waiting.queue(seq.tenant) if s.group is group]

    def _lookup(self, seq: Sequence) -> PrefixHit:
        if self.manager.enable_prefix_caching:
            seq.block_hashes = self.manager.block_hashes(seq.token_ids, seq.block_hashes, seq.params.cache_salt)
        # prompt log-probabilities need every prompt position computed: no prefix-cache hit then
        return self.manager.lookup(seq.token_ids, seq.block_hashes) if seq.params.prompt_logprobs is None \
            else PrefixHit((), 0)

    def _admit(self, seq: Sequence, budget: int, out: SchedulerOutput, scheduled_ids: set[int],
               hit: PrefixHit | None = None) -> int | None:
        """Moves a waiting sequence to running with blocks for its cache hit and a first chunk of at most `budget`
        tokens (none when the budget is spent: it computes from the next step on); the tokens scheduled, or None
        when the blocks are not there (nothing changed then). `hit`: its prefix-cache hit, if just looked up."""
        hit = hit if hit is not None else self._lookup(seq)
        num_new = min(seq.num_tokens - hit.num_tokens, budget)
        # keep a small watermark of free blocks for running decodes, so admissions do not thrash
        prompt_hashes = seq.block_hashes[:seq.num_prompt_tokens // self.manager.block_size]
        if (self.running and self.manager.blocks_needed(seq.seq_id, hit.num_tokens + num_new, hit)
                > self.manager.pool.num_free - self.watermark) or \
                not self.manager.allocate(seq.seq_id, seq.token_ids, hit, hit.num_tokens + num_new,
                                          prompt_hashes if seq.params.prompt_logprobs is None else (),
                                          seq.params.cache_salt):
            return None
        self.waiting.remove(seq)
        seq.tier_checked = False                   # asked again if it is ever preempted
        seq.num_computed = hit.num_tokens
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = hit.num_tokens
            self.prefix_queried_tokens += seq.num_prompt_tokens
            self.prefix_hit_tokens += hit.num_tokens
        seq.status = Status.RUNNING
        bisect.insort(self.running, seq, key=lambda s: s.arrival)
        if num_new:
            out.scheduled.append(ScheduledSeq(seq, num_new, seq.num_computed + num_new == seq.num_tokens))
            scheduled_ids.add(seq.seq_id)
        return num_new

    def _unadmit(self, seq: Sequence, out: SchedulerOutput, scheduled_ids: set[int]) -> int:
        """Undoes `_admit` (its group could not come in whole); returns the tokens it had scheduled."""
        took = self._unschedule(seq, out, scheduled_ids)
        self.running.remove(seq)
        self.manager.free(seq.seq_id)
        seq.num_computed = 0
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        return took

    def _unschedule(self, seq: Sequence, out: SchedulerOutput, scheduled_ids: set[int]) -> int:
        if seq.seq_id not in scheduled_ids:
            return 0
        scheduled_ids.discard(seq.seq_id)
        (entry,) = [s for s in out.scheduled if s.seq is seq]
        out.scheduled.remove(entry)
        return entry.num_new

    def _waits_for_tier(self, seq: Sequence, hit: PrefixHit) -> bool:
        """Its next prompt blocks are in the KV tier: it waits while they load (asked once per admission; a load
        that takes longer than the tier's timeout is given up, and it computes them)."""
        tier = self.tier
        if tier is None or seq.tier_checked or not self.manager.enable_prefix_caching \
                or seq.params.prompt_logprobs is not None:
            return False
        if seq.tier_load is None:
            first, limit = len(hit.blocks), (seq.num_tokens - 1) // self.manager.block_size
            seq.tier_load = tier.request(seq.block_hashes, seq.token_ids, first, limit, hit.blocks) \
                if first < limit else None
        if seq.tier_load is not None and not seq.tier_load.installed and not tier.waiting_too_long(seq.tier_load):
            return True
        seq.tier_load, seq.tier_checked = None, True
        return False

    def _inflight_hit(self, seq: Sequence, hit: PrefixHit, out: SchedulerOutput) -> PrefixHit | None:
        """In-flight dedupe and in-step sharing (the module docstring). `hit` (the prompt's cached blocks) goes on
        with the prompt blocks that other sequences compute in this step, as far as their chunks finish them;
        None where the next block after those is one another sequence computes but does not finish in this
        step: the prompt waits for it rather than compute it again. It never waits on itself, nor on a block
        nobody computes: an owner that finishes, is aborted or preempted drops its claim (BlockManager.free),
        and the waiter computes the block itself."""
        if not self.manager.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return hit
        b = self.manager.block_size
        # as the cache lookup: whole prompt blocks before the last token (a prompt computes that one itself)
        limit = min((seq.num_tokens - 1) // b, seq.num_prompt_tokens // b, len(seq.block_hashes))
        blocks = list(hit.blocks)
        ends: dict[int, ScheduledSeq | None] = {}
        while len(blocks) < limit:
            i = len(blocks)
            owner = self.manager.in_flight(seq.block_hashes[i])
            if owner is None or owner == seq.seq_id:
                break
            if owner not in ends:
                ends[owner] = next((s for s in out.scheduled if s.seq.seq_id == owner), None)
            writer = ends[owner]
            if writer is None or writer.seq.num_computed + writer.num_new < (i + 1) * b:
                return None
            if writer.seq.token_ids[i * b:(i + 1) * b] != seq.token_ids[i * b:(i + 1) * b]:
                break                           # a hash collision (never seen with blake2b): computed apart
            blocks.append(self.manager.block_at(owner, i))
        return hit if len(blocks) == len(hit.blocks) else PrefixHit(tuple(blocks), len(blocks) * b)

    def undo_joins(self, out: SchedulerOutput) -> None:
        """The step did not run (the KV backend refused it: EngineCore): a prompt that shares blocks this step was
        to write would read them unwritten later, so it goes back to the front of its queue, as if preempted, the
        sharers in their order (each preemption puts its sequence first: the last one goes first). Its admission
        did not happen: the prefix hit it recorded (`num_cached_tokens`, what the client is told) is taken at
        its next one."""
        for seq in reversed(out.joined):
            if seq.status is Status.RUNNING:
                self._preempt(seq, out, set())
                seq.num_cached_tokens = -1

    def _victim(self, scheduled_ids: set[int], exclude: str | None = None, unscheduled_only: bool = False,
                keep_one: bool = False) -> Sequence | None:
        return pick_victim(self.running, scheduled_ids if unscheduled_only else (), exclude, keep_one)

    def _victim_unscheduled(self, scheduled_ids: set[int]) -> Sequence:
        victim = self._victim(scheduled_ids, unscheduled_only=True)
        if victim is None:
            raise AssertionError("a sequence being scheduled is always unscheduled")
        return victim

    def _preempt(self, seq: Sequence, out: SchedulerOutput, scheduled_ids: set[int]) -> int:
        """Preemption by recompute: free every block; prompt + output so far is recomputed later
        (much of it will hit the prefix cache, since freed blocks keep their hashes). A beam takes its running
        siblings with it (they would wait for its logits while holding seats and blocks; the group is readmitted
        as a unit), and each forgets logits it computed: they are recomputed with it. Returns the tokens that
        were scheduled this step for what it preempted (given back to the step's budget)."""
        group = seq.group
        victims = [seq]
        if group is not None and group.beam is not None:
            victims += [s for s in group.seqs if s is not seq and s.status is Status.RUNNING]
        freed = 0
        for victim in reversed(victims):       # the group's order, kept at the front of the queue
            freed += self._unschedule(victim, out, scheduled_ids)
            self.running.remove(victim)
            self.manager.free(victim.seq_id)
            victim.num_computed = 0
            victim.pending_logprobs = None
            victim.status = Status.WAITING
            self.waiting.appendleft(victim)
            self.num_preemptions += 1
            out.preempted.append(victim)
        return freed

    def grow_ahead(self, scheduled: list[ScheduledSeq], ahead_tokens: int, max_model_len: int) -> None:
        """For backends that prepare blocks ahead of need (KVStore.ahead_tokens > 0: a backend that maps pages
        while the forward pass runs): a sequence that samples this step (its next step is a decode) and
        would fill its last block within ahead_tokens gets its next block now. Only blocks to spare beyond
        the watermark are used: growing ahead never preempts anything."""
        spare = self.manager.pool.num_free - self.watermark
        block_size = self.manager.block_size
        for s in scheduled:
            seq = s.seq
            if spare <= 0:
                return
            if not s.sample:
                continue
            last = seq.num_prompt_tokens + seq.max_tokens            # the most tokens it can ever hold
            target = min(seq.num_computed + s.num_new + 1 + ahead_tokens, max_model_len, last)
            need = -(-target // block_size) - self.manager.num_blocks(seq.seq_id)
            if 0 < need <= spare and self.manager.grow(seq.seq_id, target):
                spare -= need

    def update(self, out: SchedulerOutput) -> None:
        """After the forward pass: the scheduled tokens are now in the cache."""
        for s in out.scheduled:
            s.seq.num_computed += s.num_new
            s.seq.num_written_tokens += self.manager.commit(s.seq.seq_id, s.seq.token_ids, s.seq.num_computed,
                                                            s.seq.num_prompt_tokens)
