"""The scheduler with the block manager and pool, no model and no torch: exact schedules.

A "step" here is what the engine does around the model: schedule, mark the scheduled tokens computed
(`update`), append one token to every sequence that samples, finish sequences at their max_tokens.
"""
from __future__ import annotations

import subprocess
import sys

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.kv.block_manager import BlockManager
from engine.kv.block_pool import BlockPool
from engine.sched.scheduler import Scheduler, SchedulerOutput
from engine.sequence import SamplingParams, Sequence, Status

B = 4


def make(num_blocks: int = 64, max_num_seqs: int = 8, budget: int = 64, caching: bool = True, cost: int = 0,
         weight: float = 0.0) -> Scheduler:
    pool = BlockPool(num_blocks)
    return Scheduler(BlockManager(pool, B, "fp", caching), max_num_seqs, budget, None, cost, weight)


_ids = iter(range(10**9))


def seq(prompt_len: int, max_tokens: int = 100, first: int = 0) -> Sequence:
    sid = next(_ids)
    toks = [first + i for i in range(prompt_len)]
    return Sequence(sid, f"r{sid}", toks, SamplingParams(max_tokens=max_tokens), arrival=sid, max_tokens=max_tokens)


def step(s: Scheduler, kv: dict[int, tuple[int, ...]] | None = None) -> SchedulerOutput:
    out = s.schedule()
    if kv is not None:
        write_and_read(s, out, kv)
    s.update(out)
    for item in out.scheduled:
        if item.sample:
            item.seq.token_ids.append(7)
            if item.seq.num_output_tokens >= item.seq.max_tokens:
                s.remove(item.seq)
    return out


def decoding(s: Scheduler, prompt_len: int, first: int = 0) -> Sequence:
    """A prompt added and computed alone: it decodes from the next step on."""
    q = seq(prompt_len, first=first)
    s.add(q)
    step(s)
    return q


def added(s: Scheduler, qs: list[Sequence]) -> list[Sequence]:
    for q in qs:
        s.add(q)
    return qs


def prompts(out: SchedulerOutput) -> list[tuple[int, int]]:
    """(request id, tokens) of a step's prompt chunks (the rows of more than one token)."""
    return [(x.seq.request_id, x.num_new) for x in out.scheduled if x.num_new > 1]


def write_and_read(s: Scheduler, out: SchedulerOutput, kv: dict[int, tuple[int, ...]]) -> None:
    """What the model does with a step's cache, on a stand-in cache `kv` (cache row -> what its K / V are a
    function of: the tokens up to its position): the block copies, then every chunk's K / V written, then each
    chunk's attention reading its whole context, which must be there, whoever wrote it (in-step sharing)."""
    for src, dst in out.copies:
        for o in range(B):
            if src * B + o in kv:
                kv[dst * B + o] = kv[src * B + o]
    for x in out.scheduled:
        table = s.manager.block_table(x.seq.seq_id)
        for p in range(x.seq.num_computed, x.seq.num_computed + x.num_new):
            kv[table[p // B] * B + p % B] = tuple(x.seq.token_ids[:p + 1])
    for x in out.scheduled:
        table = s.manager.block_table(x.seq.seq_id)
        for p in range(x.seq.num_computed + x.num_new):
            assert kv.get(table[p // B] * B + p % B) == tuple(x.seq.token_ids[:p + 1]), "attends to a row not written"


def plan(out: SchedulerOutput) -> list[tuple[str, int, bool]]:
    return [(x.seq.request_id, x.num_new, x.sample) for x in out.scheduled]


def test_scheduler_imports_no_torch() -> None:
    code = ("import sys, engine.sched.scheduler, engine.kv.block_manager; "
            "assert 'torch' not in sys.modules, 'torch loaded'")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_decodes_first_then_chunked_prefill_within_the_token_budget() -> None:
    s = make(budget=10)
    a, b = seq(3), seq(25)
    s.add(a)
    assert plan(step(s)) == [(a.request_id, 3, True)]                 # a's whole prompt
    s.add(b)
    assert plan(step(s)) == [(a.request_id, 1, True), (b.request_id, 9, False)]   # decode first, then a chunk
    assert plan(step(s)) == [(a.request_id, 1, True), (b.request_id, 9, False)]
    assert plan(step(s)) == [(a.request_id, 1, True), (b.request_id, 7, True)]    # the chunk reaching the end samples
    assert plan(step(s)) == [(a.request_id, 1, True), (b.request_id, 1, True)]
    assert b.num_computed == 26 and s.manager.num_blocks(b.seq_id) == 7


def test_fcfs_without_overtaking_and_max_num_seqs() -> None:
    s = make(num_blocks=64, max_num_seqs=2, budget=100)
    x, y, z = seq(4, first=0), seq(4, first=100), seq(4, first=200)
    for q in (x, y, z):
        s.add(q)
    assert plan(step(s)) == [(x.request_id, 4, True), (y.request_id, 4, True)]
    assert [q.request_id for q in s.waiting] == [z.request_id]        # third waits: two seqs at most
    s.remove(x)
    assert plan(step(s)) == [(y.request_id, 1, True), (z.request_id, 4, True)]


def test_head_of_queue_blocks_the_rest_and_watermark() -> None:
    s = make(num_blocks=100, budget=1000)
    assert s.watermark == 1
    big = seq(4)
    s.add(big)
    step(s)                                                          # big: 1 block, then 5 tokens
    huge, tiny = seq(4 * 98, first=1000), seq(4, first=5000)
    s.add(huge)
    s.add(tiny)
    out = step(s)
    # big's decode takes a 2nd block, leaving 98 free; huge needs 98, but one is the watermark kept
    # for running decodes: it waits, and tiny (which would fit) does not overtake it
    assert plan(out) == [(big.request_id, 1, True)]
    assert [q.request_id for q in s.waiting] == [huge.request_id, tiny.request_id]
    s.remove(big)
    # nothing runs: huge needs no watermark; then tiny fits in the 2 left, one kept as the watermark
    assert plan(step(s)) == [(huge.request_id, 4 * 98, True), (tiny.request_id, 4, True)]


def test_preemption_takes_the_youngest_and_requeues_it_first() -> None:
    s = make(num_blocks=6, budget=100)
    old, young = seq(8, first=0), seq(7, first=100)
    s.add(old)
    s.add(young)
    assert plan(step(s)) == [(old.request_id, 8, True), (young.request_id, 7, True)]   # 2 + 2 blocks
    step(s)                                      # old computes token 9: a 3rd block
    step(s)                                      # young computes token 9: its 3rd block; none left
    assert s.manager.pool.num_free == 0
    assert plan(step(s)) == plan(step(s)) == [(old.request_id, 1, True), (young.request_id, 1, True)]
    out = step(s)                                # old computes token 13: a 4th block; young is preempted
    assert [q.request_id for q in out.preempted] == [young.request_id]
    assert plan(out) == [(old.request_id, 1, True)]
    assert young.status is Status.WAITING and young.num_computed == 0 and s.waiting[0] is young
    assert s.num_preemptions == 1


def test_a_prompt_that_can_never_fit_fails_when_nothing_else_runs() -> None:
    s = make(num_blocks=3, budget=100)
    q = seq(20)
    s.add(q)
    out = s.schedule()
    assert out.failed == [q] and not out.scheduled and not s.waiting


def test_prefix_hit_schedules_only_the_rest() -> None:
    s = make(budget=100)
    a = seq(12, max_tokens=1)
    s.add(a)
    step(s)                                      # computed, finished, blocks cached
    b = seq(14, max_tokens=1)                    # same first 12 tokens (ids 0..13)
    s.add(b)
    out = step(s)
    assert plan(out) == [(b.request_id, 2, True)]                     # a's 3 full blocks hit: 2 tokens left
    assert b.num_cached_tokens == 12
    assert s.prefix_hit_tokens == 12 and s.prefix_queried_tokens == 12 + 14
    c = seq(12, max_tokens=1)                    # a's prompt again: its last block is recomputed, not hit
    s.add(c)
    assert plan(step(s)) == [(c.request_id, 4, True)] and c.num_cached_tokens == 8


def test_a_step_with_decodes_admits_new_prompts_up_to_the_cost_cap_at_least_one() -> None:
    s = make(budget=100, cost=10)
    first = decoding(s, 6)
    later = added(s, [seq(6, first=100 * (i + 1)) for i in range(3)])
    # 6 + 6 would pass the cap of 10: one new prompt a step beside the decode, the others wait in order
    assert plan(step(s)) == [(first.request_id, 1, True), (later[0].request_id, 6, True)]
    assert plan(step(s)) == [(first.request_id, 1, True), (later[0].request_id, 1, True),
                             (later[1].request_id, 6, True)]
    big = seq(30, first=900)                                         # alone it passes the cap: it comes in whole
    s.add(big)
    assert [rid for rid, _ in prompts(step(s))] == [later[2].request_id]
    assert prompts(step(s)) == [(big.request_id, 30)]


def test_the_default_cap_takes_two_fresh_128_token_prompts_but_one_question_after_3072_tokens() -> None:
    # The default cap with SmolLM2-135M's weight (1/3,072): two 128-token prompts with nothing cached cost
    # 2 x 130.7 = 261 and come in together beside the decodes (at 256 they came in one a step: the offline load's
    # 48 prompts after its first step); two 78-token questions after a cached 3,072-token system prompt cost
    # 2 x 157 = 314 and still come in one a step (two a step made that load's TTFT p50 a third longer).
    from engine.config import EngineConfig
    cap, w = EngineConfig().decode_prefill_cost, 1 / 3072
    s = make(num_blocks=2048, max_num_seqs=16, budget=2048, cost=cap, weight=w)
    decoding(s, 128)
    fresh = added(s, [seq(128, first=1000 * (i + 1)) for i in range(3)])
    assert prompts(step(s)) == [(fresh[0].request_id, 128), (fresh[1].request_id, 128)]
    s2 = make(num_blocks=4096, max_num_seqs=16, budget=4096, cost=cap, weight=w)
    decoding(s2, 3072 + 1, first=10**6)                              # the system prompt is cached
    questions = [seq(3072 + 78, first=10**6) for _ in range(2)]
    for i, q in enumerate(questions):
        q.token_ids[3072:] = [5 * 10**6 + 100 * i + j for j in range(78)]
    added(s2, questions)
    assert prompts(step(s2)) == [(questions[0].request_id, 78)]
    assert prompts(step(s2)) == [(questions[1].request_id, 78)]


def test_without_decodes_the_cost_cap_does_not_apply() -> None:
    s = make(budget=100, cost=10)
    qs = [seq(6, first=100 * i) for i in range(4)]
    for q in qs:
        s.add(q)
    assert plan(step(s)) == [(q.request_id, 6, True) for q in qs]   # nothing decodes yet: the token budget only


def test_the_cost_of_a_prompt_counts_its_attention_over_the_cached_prefix() -> None:
    # weight 1/8: after a 16-token cached prefix, a 4-token rest costs 4 (1 + (16 + 2) / 8) = 13
    s = make(budget=100, cost=14, weight=1 / 8)
    assert s.prefill_cost(16, 4) == 13 and s.prefill_cost(0, 4) == 5
    owner = seq(17, max_tokens=50)
    s.add(owner)
    step(s)                                                          # its 4 full blocks are cached; it decodes
    a, b = seq(20), seq(20)                                          # the same first 16 tokens, then 4 of their own
    for i, q in enumerate((a, b)):
        q.token_ids[16:] = [500 + 10 * i + j for j in range(4)]
        s.add(q)
    out = step(s)
    assert prompts(out) == [(a.request_id, 4)]
    assert a.num_cached_tokens == 16                                  # b (13 more) would pass the cap: next step
    assert prompts(step(s)) == [(b.request_id, 4)]
    s2 = make(budget=100, cost=14)                                   # weight 0: the same two cost 4 each
    owner2 = seq(17, max_tokens=50)
    s2.add(owner2)
    step(s2)
    c, d = seq(20), seq(20)
    for i, q in enumerate((c, d)):
        q.token_ids[16:] = [500 + 10 * i + j for j in range(4)]
        s2.add(q)
    assert [rid for rid, _ in prompts(step(s2))] == [c.request_id, d.request_id]


@settings(max_examples=200, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(1, 40), st.integers(1, 12), st.integers(0, 3)), min_size=1, max_size=14),
       st.integers(8, 40), st.integers(1, 6), st.integers(4, 48), st.sampled_from([0, 1, 8, 64]))
def test_random_workloads_all_finish_within_budgets(reqs: list[tuple[int, int, int]], num_blocks: int,
                                                   max_num_seqs: int, budget: int, cost: int) -> None:
    s = make(num_blocks=num_blocks, max_num_seqs=max_num_seqs, budget=budget, cost=cost, weight=1 / 16)
    seqs = [seq(p, m, first=1000 * f) for p, m, f in reqs]       # f: a few shared prefixes
    for q in seqs:
        s.add(q)
    failed: list[Sequence] = []
    kv: dict[int, tuple[int, ...]] = {}
    for _ in range(5000):
        if not s.has_unfinished():
            break
        out = step(s, kv)
        failed += out.failed
        assert out.num_tokens <= budget and len(out.scheduled) <= max_num_seqs
        ids = [x.seq.seq_id for x in out.scheduled]
        assert len(ids) == len(set(ids))
        assert [q.arrival for q in s.running] == sorted(q.arrival for q in s.running)
        for q in s.running:                      # every computed token has its block
            assert s.manager.num_blocks(q.seq_id) * B >= q.num_computed
        pool = s.manager.pool
        assert pool.num_free == sum(1 for blk in pool.blocks if blk.ref_count == 0 and blk.pin_count == 0)
    assert not s.has_unfinished(), "a request waited forever"
    for q in seqs:
        assert q in failed or q.num_output_tokens == q.max_tokens
    assert all(-(-len(q.token_ids) // B) > num_blocks for q in failed)  # only what can never fit fails
    assert s.manager.pool.stats().used == 0


def shared(n: int, tail: int, first: int) -> Sequence:
    """A prompt of n shared tokens (0..n-1) then `tail` tokens of its own."""
    sid = next(_ids)
    toks = list(range(n)) + [first + i for i in range(tail)]
    return Sequence(sid, f"r{sid}", toks, SamplingParams(max_tokens=5), arrival=sid, max_tokens=5)


def test_cold_requests_with_one_prefix_share_it_in_the_step_that_computes_it() -> None:
    """In-step sharing: three requests arriving together with the same 16-token prefix. The first computes it;
    the others share its blocks in the same step (the step writes them before it attends) and compute only
    their own tails, so all three have their first tokens from that one step."""
    s = make(budget=25)
    a, b, c = shared(16, 3, 100), shared(16, 3, 200), shared(16, 3, 300)
    for x in (a, b, c):
        s.add(x)
    out = step(s)
    assert plan(out) == [(a.request_id, 19, True), (b.request_id, 3, True), (c.request_id, 3, True)]
    assert out.joined == [b, c]
    assert (b.num_cached_tokens, c.num_cached_tokens) == (16, 16)
    table = s.manager.block_table(a.seq_id)
    assert s.manager.block_table(b.seq_id)[:4] == s.manager.block_table(c.seq_id)[:4] == table[:4]
    assert [s.manager.pool.blocks[i].ref_count for i in table[:5]] == [3, 3, 3, 3, 1]
    assert s.prefix_queried_tokens - s.prefix_hit_tokens == 19 + 3 + 3   # the prefix once, each tail once
    assert s.manager.lookup(b.token_ids).num_tokens == 16                # hashed by a's commit


def test_a_prompt_waits_for_shared_blocks_the_step_does_not_finish() -> None:
    """A prefix computed in chunks: a prompt sharing it waits while the step's chunk does not reach the end of
    the blocks it shares, and comes in with the chunk that does."""
    s = make(budget=14)
    a, b = shared(16, 3, 100), shared(16, 3, 200)
    s.add(a)
    s.add(b)
    out = step(s)
    assert plan(out) == [(a.request_id, 14, False)] and out.joined == []   # a's chunk ends in the shared prefix
    assert list(s.waiting) == [b]                                          # (inside its last block)
    out = step(s)
    assert plan(out) == [(a.request_id, 5, True), (b.request_id, 3, True)] and out.joined == [b]
    assert b.num_cached_tokens == 16 and s.manager.block_table(b.seq_id)[:4] == s.manager.block_table(a.seq_id)[:4]


def test_sharing_stops_where_the_prompts_differ() -> None:
    """Only whole blocks that both prompts hold token for token are shared; the rest is computed apart."""
    s = make(budget=64)
    a, b = shared(10, 6, 100), shared(10, 6, 200)       # blocks 0, 1 alike; block 2 has tokens of each
    s.add(a)
    s.add(b)
    out = step(s)
    assert plan(out) == [(a.request_id, 16, True), (b.request_id, 8, True)] and b.num_cached_tokens == 8
    assert s.manager.block_table(b.seq_id)[:2] == s.manager.block_table(a.seq_id)[:2]
    assert s.manager.block_table(b.seq_id)[2] != s.manager.block_table(a.seq_id)[2]


def test_a_step_with_a_chunk_under_way_caps_new_prompts_those_sharing_it_too() -> None:
    """The cost cap applies beside a chunk of a prompt under way as beside decodes: the prompts that would share
    its blocks in that step come in after it, one within the cap a step (the module docstring says why)."""
    s = make(budget=14, cost=2)                         # weight 0: a chunk of n tokens costs n
    a, b, c = shared(16, 3, 100), shared(16, 3, 200), seq(3, first=500)
    for x in (a, b, c):
        s.add(x)
    assert plan(step(s)) == [(a.request_id, 14, False)]                   # nothing decodes: no cap
    out = step(s)
    assert plan(out) == [(a.request_id, 5, True)] and out.joined == []    # a's chunk (5) spends the cap (2)
    assert plan(step(s)) == [(a.request_id, 1, True), (b.request_id, 3, True)]   # the step's first prompt
    assert b.num_cached_tokens == 16
    assert plan(step(s)) == [(a.request_id, 1, True), (b.request_id, 1, True), (c.request_id, 3, True)]


def test_a_step_that_does_not_run_puts_its_sharers_back() -> None:
    """The KV backend refused the step (EngineCore): nothing was written, so a prompt sharing blocks that step
    was to write goes back to the front of the queue, its blocks given back, and shares them later."""
    s = make(budget=64)
    a, b = shared(16, 3, 100), shared(16, 3, 200)
    s.add(a)
    s.add(b)
    out = s.schedule()
    assert out.joined == [b]
    s.undo_joins(out)                                    # instead of update: the step never ran
    assert b.status is Status.WAITING and list(s.waiting) == [b] and b.num_computed == 0
    assert [s.manager.pool.blocks[i].ref_count for i in s.manager.block_table(a.seq_id)] == [1] * 5
    out = step(s)                                        # a again (nothing of it is computed), b with it
    assert plan(out) == [(a.request_id, 19, True), (b.request_id, 3, True)] and out.joined == [b]


def test_a_waiter_takes_over_when_the_computing_request_goes_away() -> None:
    """Never wait on a request that is cancelled (or preempted): its claim on the blocks goes with it."""
    s = make(budget=8)
    a, b = shared(16, 3, 100), shared(16, 3, 200)
    s.add(a)
    s.add(b)
    assert plan(step(s)) == [(a.request_id, 8, False)]
    s.remove(a)                                                            # aborted mid-prefill
    out = step(s)
    assert plan(out) == [(b.request_id, 8, False)] and b.num_cached_tokens == 8   # a's first block was cached

