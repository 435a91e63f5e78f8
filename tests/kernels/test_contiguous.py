"""Attention over a contiguous (vAttention) cache: the Triton kernels in their CONTIGUOUS mode and the
torch backend, against the token-by-token reference, on the cache's real layout.

The cache here is laid out as engine/kv/backends/vattention/reservation.py lays it out: one buffer
[slots, slot_len, K|V, layers, Hkv, D], token-major, so a layer's K is a strided view (rows 2 * layers * Hkv
* D apart). Sequences sit in shuffled slots; every row no sequence owns is NaN, so a read past a sequence's
length, or of the wrong slot or layer, fails the check.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kernels.contiguous_torch import ContiguousTorchBackend
from kernels.metadata import AttentionMetadata
from kernels.paged_decode import contiguous_decode
from kernels.paged_prefill import contiguous_prefill
from kernels.triton_backend import ContiguousTritonBackend
from tests.kernels.batch import DEVICE, TOL, PagedBatch, make_batch, pairwise
from tests.kernels.reference import default_scale, ref_attention

LAYERS, LAYER = 3, 1          # the buffer holds 3 layers; the test reads the middle one


@dataclass
class ContiguousBatch:
    q: torch.Tensor
    key_cache: torch.Tensor        # [num_slots, slot_len, Hkv, D], strided
    value_cache: torch.Tensor
    slot_ids: torch.Tensor         # [num_seqs] int32
    md: AttentionMetadata


def to_contiguous(b: PagedBatch, slot_len: int, seed: int) -> ContiguousBatch:
    """The same sequences in slots of a token-major buffer (spare slots stay NaN)."""
    md = b.md
    _, block_size, heads, dim = b.key_cache.shape
    num_slots = md.num_seqs + 2
    slots = torch.randperm(num_slots, generator=torch.Generator().manual_seed(seed))[:md.num_seqs].tolist()
    buf = torch.full((num_slots, slot_len, 2, LAYERS, heads, dim), float("nan"), dtype=b.key_cache.dtype)
    for slot, table, seq_len in zip(slots, b.tables, md.seq_lens_list):
        for pos in range(seq_len):
            buf[slot, pos, 0, LAYER] = b.key_cache[table[pos // block_size], pos % block_size].cpu()
            buf[slot, pos, 1, LAYER] = b.value_cache[table[pos // block_size], pos % block_size].cpu()
    buf = buf.to(b.q.device)
    rows = [slot * slot_len + pos for slot, seq_len, q_len in zip(slots, md.seq_lens_list, md.query_lens_list)
            for pos in range(seq_len - q_len, seq_len)]
    slot_ids = torch.tensor(slots, dtype=torch.int32, device=b.q.device)
    cmd = AttentionMetadata(kv_rows=torch.tensor(rows, device=b.q.device),
                            block_tables=torch.zeros(md.num_seqs, 0, dtype=torch.int32, device=b.q.device),
                            seq_lens=md.seq_lens, query_start_loc=md.query_start_loc, seq_lens_list=md.seq_lens_list,
                            query_lens_list=md.query_lens_list, max_query_len=md.max_query_len,
                            max_seq_len=md.max_seq_len, slot_ids=slot_ids)
    return ContiguousBatch(b.q, buf[:, :, 0, LAYER], buf[:, :, 1, LAYER], slot_ids, cmd)


def reference(c: ContiguousBatch) -> torch.Tensor:
    # A slot is one "block" of slot_len tokens: the reference walks table [slot] token by token.
    tables = c.slot_ids.long()[:, None].cpu()
    return ref_attention(c.q, c.key_cache.cpu(), c.value_cache.cpu(), tables, c.md.seq_lens_list,
                         c.md.query_lens_list, default_scale(c.q.shape[2]))


def poisoned(c: ContiguousBatch) -> torch.Tensor:
    return torch.full_like(c.q, float("nan"))      # an element the kernel skips fails the check


@pytest.mark.parametrize("group,head_dim,slot_len,dtype,num_splits", pairwise(
    [1, 2, 4, 8], [32, 48, 64, 128], [1032, 1040, 1100, 2048],
    [torch.float32, torch.float16, torch.bfloat16, torch.bfloat16], [1, 2, 3, 6]))
def test_decode_matches_reference(group: int, head_dim: int, slot_len: int, dtype: torch.dtype,
                                  num_splits: int) -> None:
    b = make_batch([1, 17, 1025], [1, 1, 1], num_heads=2 * group, num_kv_heads=2, head_dim=head_dim, block_size=16,
                   dtype=dtype, seed=group * 100 + head_dim)
    c = to_contiguous(b, slot_len, seed=head_dim)
    out = contiguous_decode(c.q, c.key_cache, c.value_cache, c.slot_ids, c.md.seq_lens, c.md.max_seq_len,
                            default_scale(head_dim), num_splits=num_splits, out=poisoned(c))
    # Tolerance per dtype: see TOL in tests/kernels/batch.py.
    torch.testing.assert_close(out.cpu().double(), reference(c), **TOL[dtype])


@pytest.mark.parametrize("group,head_dim,dtype,num_kv_heads", [
    (1, 64, torch.float32, 2), (2, 48, torch.float16, 1), (4, 128, torch.bfloat16, 2), (8, 32, torch.float32, 1)])
def test_prefill_matches_reference(group: int, head_dim: int, dtype: torch.dtype, num_kv_heads: int) -> None:
    # a one-token prompt, a fresh prompt, a prefix hit (cached + new) and a decode row in one batch
    b = make_batch([1, 17, 1025, 40], [1, 17, 9, 1], num_heads=group * num_kv_heads, num_kv_heads=num_kv_heads,
                   head_dim=head_dim, block_size=16, dtype=dtype, seed=group + head_dim)
    c = to_contiguous(b, 1040, seed=group)
    out = contiguous_prefill(c.q, c.key_cache, c.value_cache, c.slot_ids, c.md.seq_lens, c.md.query_start_loc,
                             c.md.max_query_len, default_scale(head_dim), out=poisoned(c))
    torch.testing.assert_close(out.cpu().double(), reference(c), **TOL[dtype])


@pytest.mark.parametrize("backend", [ContiguousTorchBackend(), ContiguousTritonBackend()], ids=["torch", "triton"])
@pytest.mark.parametrize("query_lens", [[1, 1, 1, 1], [1, 17, 9, 1]], ids=["decode", "mixed"])
def test_backends_write_then_attend(backend, query_lens: list[int]) -> None:
    """write_kv puts this step's K/V at their rows (through the strided view), then attention reads them:
    the same as the reference, and the same as the paged kernels on the paged layout of the same data."""
    b = make_batch([1, 17, 1025, 40], query_lens, num_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                   dtype=torch.float32, seed=5)
    c = to_contiguous(b, 1040, seed=9)
    expected = reference(c)
    rows = c.md.kv_rows
    c.key_cache.flatten(0, 1)[rows] = float("nan")            # this step's rows: written by write_kv only
    c.value_cache.flatten(0, 1)[rows] = float("nan")
    backend.write_kv(c.key_cache, c.value_cache, b.key, b.value, c.md)
    out = backend.forward(c.q, c.key_cache, c.value_cache, c.md, default_scale(64))
    torch.testing.assert_close(out.cpu().double(), expected, **TOL[torch.float32])


def test_strided_layer_views_do_not_leak_into_each_other() -> None:
    """Two layers of one buffer: writing layer 0 through its view leaves layer 1's rows untouched."""
    buf = torch.zeros(2, 8, 2, 2, 1, 4, device=DEVICE)
    k0, k1 = buf[:, :, 0, 0], buf[:, :, 0, 1]
    md = AttentionMetadata(kv_rows=torch.tensor([9], device=DEVICE), block_tables=torch.zeros(1, 0),
                           seq_lens=torch.tensor([2], dtype=torch.int32), query_start_loc=torch.tensor([0, 1]),
                           seq_lens_list=[2], query_lens_list=[1], max_query_len=1, max_seq_len=2,
                           slot_ids=torch.tensor([1], dtype=torch.int32))
    ContiguousTorchBackend().write_kv(k0, buf[:, :, 1, 0], torch.ones(1, 1, 4, device=DEVICE),
                                      torch.ones(1, 1, 4, device=DEVICE), md)
    assert k0[1, 1].eq(1).all() and k0.sum() == 4                 # slot 1, position 1 = row 9
    assert k1.abs().sum() == 0
