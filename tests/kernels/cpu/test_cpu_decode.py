"""The C++ CPU paged decode kernel against the token-by-token float64 reference: GQA groups, head dims,
block sizes, float32 and bfloat16 caches, split counts, cascade groups (shared leading blocks, nested,
larger than one item); metamorphic block-size and split invariance; the plan covers every block of every
sequence exactly once; its threads are torch's."""
from __future__ import annotations

import pytest
import torch

from kernels.cpu.library import CpuKernels, load
from kernels.cpu.paged_decode import MAX_MEMBERS, MIN_BLOCKS_PER_SPLIT, plan
from kernels.cpu.paged_prefill import AMX, BF16_PATHS, VECTOR
from tests.kernels.batch import PagedBatch, make_batch, make_metadata, pairwise, rebuild
from tests.kernels.cpu.conftest import BF16_BUILDS
from tests.kernels.reference import default_scale, ref_attention

MIXED = [1, 17, 1025]


def tolerance(k: CpuKernels, b: PagedBatch) -> dict[str, float]:
    """The kernel's agreement criterion (kernels/cpu/paged_decode.py): float32 products within 2e-5 of the float64
    reference (summation order and float32 rounding, ~1e-6 relative, whatever the cache dtype); bf16 products (an
    AVX-512 BF16 build over a bf16 cache, head_dim a multiple of 32: q * scale and the softmax weights rounded to
    bf16) within 0.5% of the largest |V|, the prefill kernel's bf16 criterion (the output is a weighted mean of V
    rows)."""
    if k.decode.path in BF16_PATHS and b.key_cache.dtype == torch.bfloat16 and b.q.shape[2] % 32 == 0:
        return {"atol": 5e-3 * b.value_cache.float().nan_to_num(0).abs().amax().item(), "rtol": 0.0}
    return {"atol": 2e-5, "rtol": 2e-5}


def check(k: CpuKernels, b: PagedBatch, out: torch.Tensor) -> None:
    torch.testing.assert_close(out.double(), reference(b), **tolerance(k, b))


def run(k: CpuKernels, b: PagedBatch, splits: int | None = None, cascade: bool = True,
        split_blocks: int | None = None) -> torch.Tensor:
    out = torch.full(b.q.shape, float("nan"))           # poisoned: an element the kernel skips fails the check
    return k.decode.decode(b.q.float().contiguous(), b.key_cache, b.value_cache, b.md.block_tables, b.md.seq_lens,
                           default_scale(b.q.shape[2]), out=out, num_splits=splits, cascade=cascade,
                           split_blocks=split_blocks)


def reference(b: PagedBatch) -> torch.Tensor:
    return ref_attention(b.q.float(), b.key_cache, b.value_cache, b.md.block_tables, b.md.seq_lens_list,
                         b.md.query_lens_list, default_scale(b.q.shape[2]))


@pytest.mark.parametrize("group,head_dim,block_size,dtype,splits", pairwise(
    [1, 3, 4, 8], [32, 48, 64, 128], [1, 8, 16, 32], [torch.float32, torch.bfloat16, torch.float32, torch.bfloat16],
    [1, 2, 3, 6]))
def test_cpu_decode_matches_reference(variant: CpuKernels, group: int, head_dim: int, block_size: int,
                                      dtype: torch.dtype, splits: int) -> None:
    b = make_batch(MIXED, [1, 1, 1], num_heads=2 * group, num_kv_heads=2, head_dim=head_dim,
                   block_size=block_size, dtype=dtype, seed=group * 1000 + head_dim + block_size, device="cpu")
    # The reference reads the same (bf16-rounded) cache values in float64; the kernel accumulates in float32:
    # only summation order and float32 rounding differ (~1e-6 relative), whatever the cache dtype.
    check(variant, b, run(variant, b, splits))


def test_cpu_decode_is_invariant_to_block_layout(cpu: CpuKernels) -> None:
    # Metamorphic: the same contents under block sizes 1, 16 and 32, in other random block orders, with one
    # split, give bit-identical output when the blocks partition the tokens the same way... they do not
    # (block boundaries change the online-softmax rescaling points), so: equal within float32 rounding (with bf16
    # products, within their criterion: the weights are rounded to bf16 against other running maxima).
    b16 = make_batch(MIXED, [1, 1, 1], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16,
                     dtype=torch.bfloat16, seed=7, device="cpu")
    base = run(cpu, b16, 1)
    for block_size, seed in ((1, 1), (16, 2), (32, 3)):
        other = rebuild(b16, block_size, seed)
        assert other.tables != b16.tables
        bf16 = cpu.decode.path in BF16_PATHS
        torch.testing.assert_close(run(cpu, other, 1), base, **(tolerance(cpu, b16) if bf16
                                                                else {"atol": 1e-5, "rtol": 1e-5}))
    same = rebuild(b16, 16, 9)                                   # same block size, another order: identical
    torch.testing.assert_close(run(cpu, same, 1), base, atol=0, rtol=0)


@pytest.mark.parametrize("splits", [4, 17, 40])
def test_cpu_decode_many_splits_leave_no_trace(variant: CpuKernels, splits: int) -> None:
    # 17 and 40 splits leave most splits of the short sequences empty: they must weigh nothing (no NaN).
    b = make_batch([1, 17, 1025, 700], [1, 1, 1, 1], num_heads=4, num_kv_heads=1, head_dim=64, block_size=16,
                   dtype=torch.float32, seed=splits, device="cpu")
    check(variant, b, run(variant, b, splits))


def test_cpu_decode_reads_a_layer_slice_of_the_cache(cpu: CpuKernels) -> None:
    """The engine passes key[layer] of a [layers, blocks, block_size, Hkv, D] cache: strided, not a copy."""
    b = make_batch([5, 40], [1, 1], num_heads=6, num_kv_heads=2, head_dim=64, block_size=8, dtype=torch.bfloat16,
                   seed=3, device="cpu")
    kc = torch.stack([torch.randn_like(b.key_cache, dtype=torch.float32).bfloat16(), b.key_cache])
    vc = torch.stack([torch.randn_like(b.value_cache, dtype=torch.float32).bfloat16(), b.value_cache])
    out = cpu.decode.decode(b.q.float().contiguous(), kc[1], vc[1], b.md.block_tables, b.md.seq_lens,
                            default_scale(64))
    check(cpu, b, out)


@pytest.mark.parametrize("dtype,head_dim,block_size", [(torch.bfloat16, 48, 8), (torch.float32, 64, 16)])
def test_every_variant_matches_reference(variant: CpuKernels, dtype: torch.dtype, head_dim: int,
                                         block_size: int) -> None:
    """Each build this CPU runs (its own loops: generic, avx2, avx512), with and without the cascade."""
    b = shared_prefix_batch(11, block_size=block_size, dtype=dtype) if head_dim == 64 else make_batch(
        MIXED, [1, 1, 1], num_heads=6, num_kv_heads=2, head_dim=head_dim, block_size=block_size, dtype=dtype,
        seed=4, device="cpu")
    want = {"portable": {"generic"}, "avx2": {"avx2"}, "avx512": {"avx512"}, "avx512_vnni": {"avx512"},
            "amx": {"amx", "avx512_bf16"}}.get(variant.variant, {"avx512_bf16"})   # amx: where Linux grants AMX
    assert variant.decode.path in want                       # the build runs the loops of its instruction set
    check(variant, b, run(variant, b))
    check(variant, b, run(variant, b, cascade=False))


def test_fixed_splits_make_a_row_independent_of_its_batch(cpu: CpuKernels) -> None:
    """The batch-invariant plan (split_blocks, no cascade): each sequence's output is bit for bit the same
    alone and among others, whatever the threads, while the default plan's split follows the batch."""
    b = shared_prefix_batch(3)
    together = run(cpu, b, cascade=False, split_blocks=4)
    check(cpu, b, together)
    for s in (0, 5, 11, 21):
        one = PagedBatch(b.q[s:s + 1], b.key, b.value, b.key_cache, b.value_cache,
                         make_metadata([b.md.seq_lens_list[s]], [1], [b.tables[s]], 8, "cpu"), [b.tables[s]])
        assert torch.equal(run(cpu, one, cascade=False, split_blocks=4)[0], together[s]), s
    lens = torch.tensor([1024], dtype=torch.int32)
    alone = plan(torch.arange(64, dtype=torch.int32)[None], lens, None, 16, threads=2, cascade=False, split_blocks=8)
    assert alone.items[:, 2:].tolist() == [[a, a + 8] for a in range(0, 64, 8)]


def shared_prefix_batch(seed: int, block_size: int = 8, dtype: torch.dtype = torch.bfloat16) -> PagedBatch:
    """22 sequences: 19 share their first 6 blocks (more than one item's members), 3 of those a further 3
    (nested), one of them ends right past the shared run and one exactly at a block edge; 3 share nothing."""
    lens = [6 * block_size + 1 + 7 * i for i in range(19)] + [40, 3, 200]
    lens[5] = 9 * block_size                                   # its last block is shared by nobody else
    b = make_batch(lens, [1] * len(lens), num_heads=6, num_kv_heads=2, head_dim=64, block_size=block_size,
                   dtype=dtype, seed=seed, device="cpu")
    tables = [list(t) for t in b.tables]
    for s in range(1, 19):
        tables[s][:6] = tables[0][:6]
    for s in (11, 12):
        tables[s][6:9] = tables[10][6:9]
    return PagedBatch(b.q, b.key, b.value, b.key_cache, b.value_cache,
                      make_metadata(lens, [1] * len(lens), tables, block_size, "cpu"), tables)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_matches_reference_and_the_plain_plan(cpu: CpuKernels, dtype: torch.dtype) -> None:
    b = shared_prefix_batch(5, dtype=dtype)
    p = plan(b.md.block_tables, b.md.seq_lens, None, 8)
    assert p.shared_blocks >= 18 * 6 + 2 * 3                  # the prefixes are read once, not once a sequence
    assert p.items[:, 1].max() == MAX_MEMBERS                  # the group of 19 takes two items
    cascaded, plain = run(cpu, b), run(cpu, b, cascade=False)
    check(cpu, b, cascaded)
    # Cascading changes only the merge order of each sequence's partial sums: float32 rounding apart (and with bf16
    # products, the weights rounded to bf16 against another running max: within the criterion)
    torch.testing.assert_close(cascaded, plain, **(tolerance(cpu, b) if dtype == torch.bfloat16 else
                                                   {"atol": 1e-5, "rtol": 1e-5}))


def covered(p) -> dict[tuple[int, int], int]:
    seen: dict[tuple[int, int], int] = {}
    for first, count, b0, b1 in p.items.tolist():
        for s in p.members[first:first + count].tolist():
            for blk in range(b0, b1):
                seen[(s, blk)] = seen.get((s, blk), 0) + 1
    return seen


@pytest.mark.parametrize("cascade,threads", [(True, 2), (False, 2), (True, 16), (False, 64)])
def test_plan_covers_every_block_once(cascade: bool, threads: int) -> None:
    b = shared_prefix_batch(1)
    p = plan(b.md.block_tables, b.md.seq_lens, None, 8, threads=threads, cascade=cascade)
    want = {(s, blk): 1 for s, n in enumerate(b.md.seq_lens_list) for blk in range(-(-n // 8))}
    assert covered(p) == want
    assert (p.shared_blocks > 0) == cascade
    for first, count, b0, b1 in p.items.tolist():            # a shared item reads only blocks its members share
        tables = b.md.block_tables[p.members[first:first + count].tolist(), b0:b1]
        assert (tables == tables[0]).all()
        assert count == 1 or b1 * 8 < min(b.md.seq_lens_list[s] for s in p.members[first:first + count].tolist())


def test_plan_splits_a_long_sequence_for_the_threads() -> None:
    lens = torch.tensor([1024], dtype=torch.int32)
    tables = torch.arange(64, dtype=torch.int32)[None]
    p = plan(tables, lens, None, 16, threads=2)
    assert len(p.items) == 8 and (p.items[:, 3] - p.items[:, 2]).min() >= MIN_BLOCKS_PER_SPLIT
    many = plan(tables.repeat(64, 1) + torch.arange(64, dtype=torch.int32)[:, None] * 64, lens.repeat(64), None, 16,
                threads=2)
    assert len(many.items) == 64                               # enough sequences: one item each
    short = plan(tables[:, :2], torch.tensor([20], dtype=torch.int32), None, 16, threads=2)
    assert short.items.tolist() == [[0, 1, 0, 2]]


def test_the_kernel_uses_torchs_threads(cpu: CpuKernels) -> None:
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert cpu.decode.num_threads() == 1                    # one OpenMP runtime: torch's
    finally:
        torch.set_num_threads(before)
    assert cpu.decode.num_threads() == before


def test_a_step_without_shared_prefixes_plans_in_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plan of a step whose tables share no first block is made with numpy over the sequences: the
    Python search for cascade groups runs only when two tables start alike."""
    from kernels.cpu import paged_decode

    lens = torch.full((64,), 700, dtype=torch.int32)
    tables = torch.arange(64 * 44, dtype=torch.int32).view(64, 44)

    def no_search(*_args: object) -> None:
        raise AssertionError("searched for cascade groups")

    monkeypatch.setattr(paged_decode, "_find_shared", no_search)
    p = plan(tables, lens, None, 16, threads=2)
    assert covered(p) == {(s, blk): 1 for s in range(64) for blk in range(44)} and p.shared_blocks == 0
    monkeypatch.undo()
    tables[1, :3] = tables[0, :3]                            # two alike: the search runs, and finds them
    assert plan(tables, lens, None, 16, threads=2).shared_blocks == 3


def with_tiles(k: CpuKernels, tiles: int, b: PagedBatch, **kw: object) -> torch.Tensor:
    with k.decode.forced_tiles(tiles):
        return run(k, b, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("build", BF16_BUILDS or [None])
@pytest.mark.parametrize("head_dim,heads", [(64, 3), (32, 4), (128, 2), (96, 1)])
def test_amx_tiles_take_a_cascade_groups_items(build: str | None, head_dim: int, heads: int) -> None:
    """A cascade group of 19 sequences (items of 16 and 3 members) over a shared prefix, with the AMX tiles forced
    (real on an AMX build, emulated elsewhere): within the criterion of float64 and of the vector tiles, not their
    bits where an item has 16 rows or more (the AMX code ran), and the plain plan's items (a sequence's own rows,
    under 16) bit for bit the vector tiles'."""
    if build is None:
        pytest.skip("no build with bf16 products runs here")
    k = load(build)
    lens = [6 * 8 + 1 + 7 * i for i in range(19)] + [40, 3]
    b = make_batch(lens, [1] * len(lens), num_heads=2 * heads, num_kv_heads=2, head_dim=head_dim, block_size=8,
                   dtype=torch.bfloat16, seed=head_dim + heads, device="cpu")
    tables = [list(t) for t in b.tables]
    for s in range(1, 19):
        tables[s][:6] = tables[0][:6]
    b = PagedBatch(b.q, b.key, b.value, b.key_cache, b.value_cache,
                   make_metadata(lens, [1] * len(lens), tables, 8, "cpu"), tables)
    amx, vec = with_tiles(k, AMX, b), with_tiles(k, VECTOR, b)
    check(k, b, amx)
    torch.testing.assert_close(amx, vec, **tolerance(k, b))
    assert not torch.equal(amx, vec)
    assert torch.equal(with_tiles(k, AMX, b, cascade=False, split_blocks=4),
                       with_tiles(k, VECTOR, b, cascade=False, split_blocks=4))


def test_set_tiles_refuses_other_values(cpu: CpuKernels) -> None:
    with pytest.raises(ValueError):
        cpu.decode.set_tiles(3)
