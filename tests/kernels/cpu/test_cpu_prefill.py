"""The C++ CPU paged prefill kernel, every build this CPU runs (portable loops, avx2, avx512, avx512_bf16, amx),
and each build with AVX-512 BF16 once more with the AMX tiles forced (`+amx_tiles`: emulated where the CPU has
no AMX, kernels/cpu/amx_tile.h), bf16 and float32 caches, against the float64 reference that walks the block
table token by token, within its stated criterion (kernels/cpu/paged_prefill.py: float32 products within 1e-5 of
the largest |V|, bf16 products within 0.5%); outputs poisoned with NaN before each launch. Metamorphic checks,
bit for bit: chunked vs whole, block size 1 vs 16, cascade vs not, a sequence alone vs in a group that shares its
prefix, any thread count."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.cpu import paged_prefill as pp
from kernels.cpu.library import CpuKernels, load
from tests.kernels.batch import PagedBatch, make_batch, make_metadata, pairwise, rebuild
from tests.kernels.cpu.conftest import BF16_BUILDS, VARIANTS, kernels_of
from tests.kernels.reference import default_scale, ref_attention

# Tolerances against the float64 reference, as a share of the largest |V| (the output is a weighted mean of
# V rows): float32 products and sums over at most a few thousand keys differ from float64 by float32 rounding
# (measured ~2e-7); bf16 products round q * scale and the softmax weights to bf16 (measured 0.07-0.15%); int16
# products round q * scale, K, V and the weights to 2^-13.5 of each vector's largest.
F32_TOL, BF16_TOL = 1e-5, 5e-3


@pytest.fixture(params=[*VARIANTS, *(f"{v}+amx_tiles" for v in BF16_BUILDS)] or [None], ids=lambda v: v or "none-built")
def variant(request: pytest.FixtureRequest) -> CpuKernels:
    """Every build this CPU runs, as conftest's, and the builds with bf16 products again with the AMX tiles."""
    return kernels_of(request.param)


def tolerance(k: CpuKernels, dtype: torch.dtype, head_dim: int) -> float:
    return BF16_TOL if k.prefill.path(dtype, head_dim) in pp.BF16_PATHS + pp.I16_PATHS else F32_TOL


def run(k: CpuKernels, b: PagedBatch, seqs: list[int] | None = None, scale: float | None = None,
        cascade: bool = True) -> torch.Tensor:
    out = torch.full(b.q.shape, float("nan"))           # poisoned: a row the kernel skips stays NaN
    seqs = list(range(len(b.md.seq_lens_list))) if seqs is None else seqs
    res = k.prefill.prefill(b.q.float().contiguous(), b.key_cache, b.value_cache, b.md.block_tables,
                            b.md.seq_lens, b.md.query_start_loc, seqs, scale or default_scale(b.q.shape[2]), out,
                            cascade=cascade)
    assert res is not None
    return res


def stats(k: CpuKernels, b: PagedBatch, cascade: bool = True) -> pp.PrefillStats:
    out = torch.empty(b.q.shape)
    s = k.prefill.prefill_stats(b.q.float().contiguous(), b.key_cache, b.value_cache, b.md.block_tables,
                                b.md.seq_lens, b.md.query_start_loc, list(range(len(b.md.seq_lens_list))),
                                default_scale(b.q.shape[2]), out, cascade=cascade)
    assert s is not None
    return s


def within_criterion(k: CpuKernels, b: PagedBatch, out: torch.Tensor, scale: float | None = None) -> float:
    before = torch.get_num_threads()
    torch.set_num_threads(1)        # the reference's thousands of tiny ops: 2 threads on a busy machine, 10x slower
    try:
        ref = ref_attention(b.q.float(), b.key_cache, b.value_cache, b.md.block_tables, b.md.seq_lens_list,
                            b.md.query_lens_list, scale or default_scale(b.q.shape[2]))
    finally:
        torch.set_num_threads(before)
    vmax = b.value_cache.float().nan_to_num(0).abs().amax().item()
    err = (out.double() - ref).abs().max().item() / vmax
    assert err <= tolerance(k, b.key_cache.dtype, b.q.shape[2]), err
    return err


def with_tables(b: PagedBatch, tables: list[list[int]]) -> PagedBatch:
    """b with other block tables (sequences pointing at each other's blocks: a shared prefix)."""
    block_size = b.key_cache.shape[1]
    return PagedBatch(b.q, b.key, b.value, b.key_cache, b.value_cache,
                      make_metadata(b.md.seq_lens_list, b.md.query_lens_list, tables, block_size, "cpu"), tables)


def shared_prefix_batch(seed: int, block_size: int = 16, dtype: torch.dtype = torch.bfloat16, prefix: int = 320,
                        own: tuple[int, ...] = (64, 40, 64, 1, 80), query: tuple[int, ...] = (64, 40, 30, 1, 80),
                        num_heads: int = 9, num_kv_heads: int = 3, head_dim: int = 64) -> PagedBatch:
    """Sequences whose first `prefix` tokens are the same blocks (sequence 0's), each with `own` tokens of its
    own, the last `query` of which are this step's chunk (a chunk may start inside the shared blocks)."""
    lens = [prefix + n for n in own]
    b = make_batch(lens, list(query), num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                   block_size=block_size, dtype=dtype, seed=seed, device="cpu")
    shared = prefix // block_size
    tables = [list(t) for t in b.tables]
    for t in tables[1:]:
        t[:shared] = tables[0][:shared]
    return with_tables(b, tables)


@pytest.mark.parametrize("group,head_dim,block_size,dtype",
                         pairwise([1, 3, 4, 8], [64, 128, 32, 80], [1, 8, 16, 32],
                                  [torch.bfloat16, torch.float32, torch.bfloat16, torch.bfloat16]))
def test_cpu_prefill_matches_reference(variant: CpuKernels, group: int, head_dim: int, block_size: int,
                                       dtype: torch.dtype) -> None:
    # whole prompts, chunks over a cached context (cut mid-tile and mid-block), a one-token chunk
    b = make_batch([100, 1100, 70, 9], [100, 40, 1, 9], num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                   block_size=block_size, dtype=dtype, seed=group * 100 + head_dim + block_size, device="cpu")
    within_criterion(variant, b, run(variant, b))


def test_cpu_prefill_sharp_attention(variant: CpuKernels) -> None:
    # scores of tens (a large scale): the running max moves tile after tile, weights far below the best
    b = make_batch([300, 257], [300, 130], num_heads=6, num_kv_heads=2, head_dim=64, block_size=16,
                   dtype=torch.bfloat16, seed=5, device="cpu")
    within_criterion(variant, b, run(variant, b, scale=1.0), scale=1.0)


def test_cpu_prefill_computes_only_the_listed_sequences(variant: CpuKernels) -> None:
    b = make_batch([50, 80, 33], [1, 20, 1], num_heads=6, num_kv_heads=2, head_dim=64, block_size=16,
                   dtype=torch.bfloat16, seed=3, device="cpu")
    out = run(variant, b, seqs=[1])
    starts = b.md.query_start_loc.tolist()
    assert out[starts[0]:starts[1]].isnan().all() and out[starts[2]:starts[3]].isnan().all()
    assert not out[starts[1]:starts[2]].isnan().any()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_prefill_is_chunk_invariant_bit_for_bit(variant: CpuKernels, dtype: torch.dtype) -> None:
    # One 300-token prompt computed whole, then as chunks over its cached context cut at 1, 37, 64, 200 and
    # 299 tokens: every token's output is identical bit for bit (the criterion the prefix cache relies on).
    length = 300
    whole = make_batch([length], [length], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                       dtype=dtype, seed=11, device="cpu")
    full = run(variant, whole)
    for cut in (1, 37, 64, 200, 299):
        # the same cache and queries; the step computes the tokens past `cut` only (and, as a second
        # sequence on the same blocks, the tokens up to `cut` as a prompt of their own)
        q = torch.cat([whole.q[cut:], whole.q[:cut]])
        md = whole.md
        tables = torch.cat([md.block_tables, md.block_tables])
        lens = torch.tensor([length, cut], dtype=torch.int32)
        starts = torch.tensor([0, length - cut, length], dtype=torch.int32)
        out = torch.full(q.shape, float("nan"))
        res = variant.prefill.prefill(q.float().contiguous(), whole.key_cache, whole.value_cache, tables, lens,
                                      starts, [0, 1], default_scale(64), out)
        assert res is not None
        assert torch.equal(res[:length - cut], full[cut:]), cut
        assert torch.equal(res[length - cut:], full[:cut]), cut


def test_cpu_prefill_is_invariant_to_block_size(variant: CpuKernels) -> None:
    # the same tokens in blocks of 16 and of 1 (another random placement): the same output, bit for bit
    # (tiles are aligned to positions, not to blocks)
    b16 = make_batch([200, 90, 64], [70, 90, 1], num_heads=8, num_kv_heads=2, head_dim=128, block_size=16,
                     dtype=torch.bfloat16, seed=9, device="cpu")
    b1 = rebuild(b16, 1, seed=10)
    assert torch.equal(run(variant, b16), run(variant, b1))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cascade_walks_a_shared_prefix_once_and_changes_no_bit(variant: CpuKernels, dtype: torch.dtype) -> None:
    # five sequences on one 320-token prefix (5 tiles); the chunk of sequence 2 starts 34 tokens into its own
    # part, sequence 3's is its last token, sequence 4 has 80 own tokens
    b = shared_prefix_batch(1, dtype=dtype)
    s, plain = stats(variant, b), stats(variant, b, cascade=False)
    assert (s.groups, s.grouped_keys) == (1, 5 * 320)       # phase 1 walks the 5 tiles for the 5 members at once
    assert (plain.groups, plain.grouped_keys) == (0, 0) and plain.keys > s.keys
    cascaded = run(variant, b)
    within_criterion(variant, b, cascaded)
    # saving each row's softmax state after the shared tiles and resuming from it changes nothing
    assert torch.equal(cascaded, run(variant, b, cascade=False))
    # each sequence alone (no group possible) gets the same rows
    starts = b.md.query_start_loc.tolist()
    for i in range(len(starts) - 1):
        alone = run(variant, b, seqs=[i], cascade=False)
        assert torch.equal(alone[starts[i]:starts[i + 1]], cascaded[starts[i]:starts[i + 1]]), i


def test_cascade_is_invariant_to_block_size(variant: CpuKernels) -> None:
    # the same shared-prefix step with blocks of 16 and of 1: the same groups, the same output bit for bit
    b16 = shared_prefix_batch(2, block_size=16, num_heads=8, num_kv_heads=1, head_dim=128)
    b1 = rebuild(b16, 1, seed=3)                               # the same tokens, each sequence in blocks of its own
    b1 = with_tables(b1, [b1.tables[0][:320] + t[320:] for t in b1.tables])     # the prefix shared again
    assert stats(variant, b16) == stats(variant, b1)
    assert torch.equal(run(variant, b16), run(variant, b1))


def test_cascade_groups_who_shares_most(variant: CpuKernels) -> None:
    """Sequence 0 shares only its first block with the rest (it leads the search and is dropped); 1-3 share 5
    tiles; 4 shares 2 tiles with them and 6 shares 5, but 6's chunk starts at 220, so its rows see only 3 whole
    tiles before it: a group of 1-3 over 5 tiles (2 x 5 tiles saved beat 3 x 3 or 4 x 2), then 4 and 6 over
    2 tiles; 5 starts with other blocks."""
    own = (96, 64, 64, 64, 64, 64, 100)
    b = make_batch([320 + n for n in own], [64, 64, 20, 1, 64, 64, 200], num_heads=4, num_kv_heads=2, head_dim=64,
                   block_size=16, dtype=torch.bfloat16, seed=4, device="cpu")
    tables = [list(t) for t in b.tables]
    for s in (1, 2, 3, 4, 6):
        tables[s][:1] = tables[0][:1]
    for s in (2, 3, 6):
        tables[s][:20] = tables[1][:20]
    tables[4][:8] = tables[1][:8]
    b = with_tables(b, tables)
    s = stats(variant, b)
    assert (s.groups, s.grouped_keys) == (2, 3 * 320 + 2 * 128)
    cascaded = run(variant, b)
    within_criterion(variant, b, cascaded)
    assert torch.equal(cascaded, run(variant, b, cascade=False))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_prefill_does_not_depend_on_the_thread_count(variant: CpuKernels, dtype: torch.dtype) -> None:
    # the threads decide how rows are cut into items (and phase 1's items across members): no bit changes
    b = shared_prefix_batch(3, dtype=dtype)
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 3, 8):
            torch.set_num_threads(threads)
            outs.append(run(variant, b))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def test_a_short_chunk_after_a_long_context_is_cut_for_the_threads(variant: CpuKernels) -> None:
    # A question after a system prompt: 78 tokens after 3,072 cached, 3 KV heads of 3 query heads. On two
    # threads the plan cuts the chunk into 2 items of 39 tokens a KV head (6 items, 3 a thread: keys walked
    # 3,111 + 3,150 a head), not into items of 32 or 16 tokens; one thread takes items of up to 64 tokens
    # (78 = 39 + 39 as well), four threads 4 items a head. Every cut gives the same bits.
    b = make_batch([3150], [78], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16, dtype=torch.bfloat16,
                   seed=21, device="cpu")
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert stats(variant, b).keys == (3072 + 39) + 3150
        two = run(variant, b)
        torch.set_num_threads(4)         # 12 items of 20 tokens (the last 18): 3 a thread
        assert stats(variant, b).keys == (3072 + 20) + (3072 + 40) + (3072 + 60) + 3150
        four = run(variant, b)
    finally:
        torch.set_num_threads(before)
    assert torch.equal(two, four)
    within_criterion(variant, b, two)


def test_the_int16_tiles_pack_a_tile_once_for_all_the_items_that_walk_it(variant: CpuKernels) -> None:
    # A 300-token prompt computed whole: 5 items of 60 tokens a KV head on two threads, item i walking tiles 0..i,
    # so tiles 0-3 are walked by two items or more and packed once before the items run (the int16 tiles), tile 4
    # by the last item alone, which packs it. A 78-token question after 3,072 cached tokens: 2 items a head, both
    # over tiles 0-48 (3,111 keys), the second alone over tile 49. One token: a single item, nothing packed
    # ahead. Other tiles pack in each item. The bits do not depend on who packed a tile (chunk invariance, above).
    def packed(total: int, new: int) -> int:
        b = make_batch([total], [new], num_heads=9, num_kv_heads=3, head_dim=64, block_size=16,
                       dtype=torch.bfloat16, seed=11, device="cpu")
        return stats(variant, b).packed_tiles

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        counts = [packed(300, 300), packed(3150, 78), packed(300, 1)]
    finally:
        torch.set_num_threads(before)
    assert counts == ([4, 49, 0] if variant.prefill.path(torch.bfloat16) in pp.I16_PATHS else [0, 0, 0])


def test_cpu_prefill_declines_what_it_does_not_take(variant: CpuKernels) -> None:
    b = make_batch([20], [20], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16,
                   seed=1, device="cpu")
    out = torch.empty(b.q.shape)
    assert variant.prefill.prefill(b.q.float(), b.key_cache, b.value_cache, b.md.block_tables, b.md.seq_lens,
                                   b.md.query_start_loc, [0], 0.125, out) is None     # float16: the flash path
    assert not pp.supports(4, 2, 72, torch.bfloat16)                                   # head_dim % 16 != 0
    assert not pp.supports(36, 2, 64, torch.bfloat16)                                  # 18 query heads a KV head


@pytest.mark.parametrize("head_dim,group", [(64, 3), (32, 1), (96, 2), (128, 4)])
def test_amx_tiles_run_and_agree_with_the_vector_tiles(head_dim: int, group: int) -> None:
    """The AMX tiles (real on an AMX build, emulated elsewhere) take every head_dim a multiple of 32, rows in blocks
    of 16 cut anywhere (a one-token chunk, 21 and 37 tokens x G heads, a chunk starting mid-tile after a cached
    context): within the bf16 criterion of float64, and not the vector tiles' bits (the float32 sums' order
    differs), so the AMX code is what ran."""
    if not BF16_BUILDS:
        pytest.skip("no build with bf16 products runs here")
    k = load(BF16_BUILDS[-1])
    b = make_batch([300, 21, 1, 150], [37, 21, 1, 150], num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                   block_size=16, dtype=torch.bfloat16, seed=head_dim + group, device="cpu")
    amx = dataclasses.replace(k, prefill=k.prefill.with_tiles(pp.AMX))
    vec = dataclasses.replace(k, prefill=k.prefill.with_tiles(pp.VECTOR))
    a, v = run(amx, b), run(vec, b)
    within_criterion(amx, b, a)
    within_criterion(vec, b, v)
    assert not torch.equal(a, v)
    assert (a - v).abs().max().item() < BF16_TOL * b.value_cache.float().nan_to_num(0).abs().amax().item()


def test_amx_tiles_leave_float32_caches_and_odd_head_dims_to_the_other_loops() -> None:
    if not BF16_BUILDS:
        pytest.skip("no build with bf16 products runs here")
    k = load(BF16_BUILDS[-1])
    amx = dataclasses.replace(k, prefill=k.prefill.with_tiles(pp.AMX))
    for dtype, head_dim in ((torch.float32, 64), (torch.bfloat16, 80)):
        b = make_batch([40, 9], [40, 9], num_heads=4, num_kv_heads=2, head_dim=head_dim, block_size=16, dtype=dtype,
                       seed=7, device="cpu")
        assert torch.equal(run(amx, b), run(k, b))
