"""Paged prefill / extend attention: a variable-length chunk of new tokens per sequence.

    | cached prefix (seen fully) | new tokens (seen causally) |
    0                        ctx_len                       seq_len        ctx_len = seq_len - query_len

Both regions are read through the block table (or, CONTIGUOUS, as rows 0 .. seq_len - 1 of the
sequence's slot: `contiguous_prefill`): write_kv has already put the new tokens' K/V in their slots.
Flash-attention tiling with an online softmax in base 2 and fp32 accumulation.

Grid (num_seqs, cdiv(max_query_len, BLOCK_Q), num_kv_heads). A program owns BLOCK_Q query tokens
of one sequence and all GROUP query heads of one KV head (GQA): its BLOCK_M = BLOCK_Q * GROUP_PAD
rows are (token, head) pairs, row r = token r // GROUP_PAD, head r % GROUP_PAD, so each K/V tile
is loaded once for the group. Programs past a sequence's query length exit at once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.paged_decode import LOG2E, check_contiguous_inputs, check_paged_inputs, dot_dtype, load_kv_tile


@triton.jit
def paged_prefill_kernel(
    Q,                         # [num_tokens, num_heads, head_dim]
    KEY_CACHE, VALUE_CACHE,    # [num_blocks, block_size, num_kv_heads, head_dim]
    BLOCK_TABLES,              # [num_seqs, max_blocks] int32 (CONTIGUOUS: SLOT_IDS [num_seqs] int32)
    SEQ_LENS,                  # [num_seqs] int32, context incl. the new tokens
    QUERY_START_LOC,           # [num_seqs + 1] int32
    OUT,                       # [num_tokens, num_heads, head_dim]
    qk_scale,                  # softmax scale * log2(e)
    stride_q_tok, stride_q_head,
    stride_kc_block, stride_kc_tok, stride_kc_head,
    stride_vc_block, stride_vc_tok, stride_vc_head,
    stride_bt_seq,
    stride_o_tok, stride_o_head,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)

    q_start = tl.load(QUERY_START_LOC + seq).to(tl.int64)
    q_len = (tl.load(QUERY_START_LOC + seq + 1) - q_start).to(tl.int32)
    if q_block * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(SEQ_LENS + seq)
    ctx_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    q_idx = q_block * BLOCK_Q + offs_m // GROUP_PAD          # [BLOCK_M] token within the chunk
    g = offs_m % GROUP_PAD
    heads = kv_head * GROUP + g
    m_mask = (q_idx < q_len) & (g < GROUP)
    d_mask = offs_d < HEAD_DIM
    q_pos = ctx_len + q_idx                                  # [BLOCK_M] position in the sequence

    q_rows = (q_start + q_idx).to(tl.int64)
    q = tl.load(Q + q_rows[:, None] * stride_q_tok + heads[:, None] * stride_q_head + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)             # [BLOCK_M, HEAD_DIM_PAD]
    q = q.to(DOT_DTYPE)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)

    # Keys this tile can see: the whole prefix plus the chunk up to its last query token.
    kv_end = ctx_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
    bt_row = BLOCK_TABLES + seq * stride_bt_seq
    kc_head = KEY_CACHE + kv_head * stride_kc_head
    vc_head = VALUE_CACHE + kv_head * stride_vc_head
    for tile_start in range(0, kv_end, BLOCK_N):
        pos = tile_start + offs_n                                              # [BLOCK_N]
        n_mask = pos < kv_end
        k, v = load_kv_tile(bt_row, kc_head, vc_head, pos, n_mask, offs_d, d_mask, stride_kc_block,
                            stride_kc_tok, stride_vc_block, stride_vc_tok, BLOCK_SIZE, CONTIGUOUS)
        s = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION) * qk_scale         # [BLOCK_M, BLOCK_N]
        visible = n_mask[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # NOTE: a row with nothing visible yet keeps m = -inf; shift by 0 instead so that
        # exp2(-inf - -inf) never yields NaN (its p and alpha are then exactly 0).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new

    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(OUT + q_rows[:, None] * stride_o_tok + heads[:, None] * stride_o_head + offs_d[None, :],
             (acc / l_safe[:, None]).to(OUT.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def paged_prefill(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                  seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """q [num_tokens, num_heads, head_dim]: each sequence's new tokens, K/V already in the cache -> out."""
    block_size, num_kv_heads, head_dim = check_paged_inputs(q, key_cache, value_cache, block_tables, seq_lens)
    assert block_tables.shape[0] == seq_lens.shape[0]
    return _prefill(q, key_cache, value_cache, block_tables, block_tables.stride(0), seq_lens, query_start_loc,
                    max_query_len, scale, block_size, num_kv_heads, head_dim, False, out)


def contiguous_prefill(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_ids: torch.Tensor,
                       seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int, scale: float,
                       out: torch.Tensor | None = None) -> torch.Tensor:
    """The same over a contiguous (vAttention) cache [num_slots, slot_len, Hkv, D]: sequence i is rows
    0 .. seq_lens[i] - 1 of slot slot_ids[i]; no block table."""
    num_kv_heads, head_dim = check_contiguous_inputs(q, key_cache, value_cache, slot_ids, seq_lens)
    return _prefill(q, key_cache, value_cache, slot_ids, 1, seq_lens, query_start_loc, max_query_len, scale, 1,
                    num_kv_heads, head_dim, True, out)


def _prefill(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, table: torch.Tensor,
             stride_table: int, seq_lens: torch.Tensor, query_start_loc: torch.Tensor, max_query_len: int,
             scale: float, block_size: int, num_kv_heads: int, head_dim: int, contiguous: bool,
             out: torch.Tensor | None) -> torch.Tensor:
    num_tokens, num_heads, _ = q.shape
    num_seqs = seq_lens.shape[0]
    assert query_start_loc.dtype == torch.int32 and query_start_loc.shape == (num_seqs + 1,)
    assert query_start_loc.is_contiguous()
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if num_tokens == 0 or num_seqs == 0:
        return out

    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    # Rows per program: 128 (64 for head_dim > 128), but no more query tokens than the longest chunk
    # needs, so short chunks and decode rows in a mixed batch do not pad a 128-row tile; >= 16 rows
    # keep tl.dot on tensor cores.
    block_q = max(1, (128 if head_dim_pad <= 128 else 64) // group_pad)
    block_q = max(min(block_q, triton.next_power_of_2(max_query_len)), triton.cdiv(16, group_pad))
    block_m = block_q * group_pad
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    paged_prefill_kernel[grid](
        q, key_cache, value_cache, table, seq_lens, query_start_loc, out,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        stride_table,
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=group_pad,
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q, BLOCK_M=block_m, BLOCK_N=64,
        DOT_DTYPE=dot_dtype(q.dtype), DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        CONTIGUOUS=contiguous,
        num_warps=8 if block_m >= 128 else 4,
    )
    return out
