"""Paged decode attention: one query token per sequence, K/V read through the block table.

Grid (num_seqs, num_kv_heads, num_splits). One program owns one KV head of one sequence and the
GROUP = num_heads // num_kv_heads query heads that share it (GQA), so every K/V tile is loaded once
for the whole group; the group is padded to >= 16 rows so the two products are tensor-core dots.

Split-KV (flash-decoding): the context of each sequence is cut into num_splits ranges of whole tiles

    | split 0 | split 1 | ... | split s-1 |        (a short sequence leaves its last splits empty)

each program writes its split's running max, sum and unnormalized accumulator to fp32 workspaces,
and `paged_decode_reduce_kernel` rescales and merges them. An empty split writes (max=-inf, sum=0,
acc=0) and the reduction gives it weight 0 explicitly, so it never turns into exp(-inf - -inf) = NaN.
With num_splits == 1 the main kernel normalizes and writes the output itself (no second launch).

The same kernel reads a contiguous (vAttention) cache when CONTIGUOUS: sequence i's context is rows
0 .. seq_len - 1 of slot SLOT_IDS[i] (`contiguous_decode`), with no block table to load.

Softmax runs in base 2 (scale folded with log2(e)), accumulation is fp32 whatever the cache dtype.
fp32 caches use "ieee" dots (no silent tf32); fp16 / bf16 use the target's default (tensor cores).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

LOG2E = 1.4426950408889634
TILE_TOKENS = 64            # tokens per K/V tile (gathered token by token through the block table)
MIN_TOKENS_PER_SPLIT = 512  # below this a split's partial writes cost more than its reads save
MAX_SPLITS = 64


@triton.jit
def load_kv_tile(bt_row, kc_head, vc_head, pos, n_mask, offs_d, d_mask,
                 stride_kc_block, stride_kc_tok, stride_vc_block, stride_vc_tok, BLOCK_SIZE: tl.constexpr,
                 CONTIGUOUS: tl.constexpr):
    """K^T [HEAD_DIM_PAD, BLOCK_N] and V [BLOCK_N, HEAD_DIM_PAD] of the positions `pos` of one sequence and
    KV head (masked positions read as 0). Paged: gathered token by token through its block table row.
    CONTIGUOUS (vAttention): `bt_row` points at the sequence's slot id, whose rows are contiguous
    positions (slot * stride_block + pos * stride_tok); masked lanes address row 0 of the slot, never
    past the sequence (nothing is mapped there)."""
    if CONTIGUOUS:
        block = tl.load(bt_row + pos * 0).to(tl.int64)                   # the slot, in every lane
        in_block = tl.where(n_mask, pos, 0).to(tl.int64)
    else:
        block = tl.load(bt_row + pos // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        in_block = (pos % BLOCK_SIZE).to(tl.int64)
    k = tl.load(kc_head + block[None, :] * stride_kc_block + in_block[None, :] * stride_kc_tok
                + offs_d[:, None], mask=d_mask[:, None] & n_mask[None, :], other=0.0)
    v = tl.load(vc_head + block[:, None] * stride_vc_block + in_block[:, None] * stride_vc_tok
                + offs_d[None, :], mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    return k, v


@triton.jit
def paged_decode_kernel(
    Q,                         # [num_seqs, num_heads, head_dim]
    KEY_CACHE, VALUE_CACHE,    # [num_blocks, block_size, num_kv_heads, head_dim]
    BLOCK_TABLES,              # [num_seqs, max_blocks] int32 (CONTIGUOUS: SLOT_IDS [num_seqs] int32)
    SEQ_LENS,                  # [num_seqs] int32
    OUT,                       # [num_seqs, num_heads, head_dim]            (NUM_SPLITS == 1)
    PART_ACC,                  # [num_seqs, num_heads, NUM_SPLITS, head_dim] fp32 (NUM_SPLITS > 1)
    PART_MAX, PART_SUM,        # [num_seqs, num_heads, NUM_SPLITS] fp32, max in log2 units
    qk_scale,                  # softmax scale * log2(e)
    stride_q_seq, stride_q_head,
    stride_kc_block, stride_kc_tok, stride_kc_head,
    stride_vc_block, stride_vc_tok, stride_vc_head,
    stride_bt_seq,
    stride_o_seq, stride_o_head,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_DTYPE: tl.constexpr, DOT_PRECISION: tl.constexpr,
    CONTIGUOUS: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(SEQ_LENS + seq)
    # Whole tiles per split, so that only the context's last tile is partial.
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kv_head * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM

    q = tl.load(Q + seq * stride_q_seq + heads[:, None] * stride_q_head + offs_d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)          # [GROUP_PAD, HEAD_DIM_PAD]
    q = q.to(DOT_DTYPE)

    m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)

    bt_row = BLOCK_TABLES + seq * stride_bt_seq
    kc_head = KEY_CACHE + kv_head * stride_kc_head
    vc_head = VALUE_CACHE + kv_head * stride_vc_head
    for tile_start in range(start, end, BLOCK_N):
        pos = tile_start + offs_n                                            # [BLOCK_N]
        n_mask = pos < end
        k, v = load_kv_tile(bt_row, kc_head, vc_head, pos, n_mask, offs_d, d_mask, stride_kc_block,
                            stride_kc_tok, stride_vc_block, stride_vc_tok, BLOCK_SIZE, CONTIGUOUS)
        s = tl.dot(q, k.to(DOT_DTYPE), input_precision=DOT_PRECISION) * qk_scale      # [GROUP_PAD, BLOCK_N]
        s = tl.where(n_mask[None, :], s, float("-inf"))
        # The tile holds >= 1 valid token (tile_start < end), so m_new is finite.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(DOT_DTYPE), v.to(DOT_DTYPE), input_precision=DOT_PRECISION)
        m_i = m_new

    out_mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        tl.store(OUT + seq * stride_o_seq + heads[:, None] * stride_o_head + offs_d[None, :],
                 (acc / l_safe[:, None]).to(OUT.dtype.element_ty), mask=out_mask)
    else:
        # Workspaces are contiguous: row (seq, head) holds NUM_SPLITS entries.
        row = seq * (GROUP * tl.num_programs(1)) + heads                    # [GROUP_PAD] flat (seq, head)
        tl.store(PART_MAX + row * NUM_SPLITS + split, m_i, mask=g_mask)
        tl.store(PART_SUM + row * NUM_SPLITS + split, l_i, mask=g_mask)
        tl.store(PART_ACC + (row[:, None] * NUM_SPLITS + split) * HEAD_DIM + offs_d[None, :], acc, mask=out_mask)


@triton.jit
def paged_decode_reduce_kernel(
    PART_ACC,                  # [num_seqs, num_heads, NUM_SPLITS, head_dim] fp32
    PART_MAX, PART_SUM,        # [num_seqs, num_heads, NUM_SPLITS] fp32
    OUT,                       # [num_seqs, num_heads, head_dim]
    stride_o_seq, stride_o_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr,
):
    seq = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    row = seq * NUM_HEADS + head

    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    s_mask = offs_s < NUM_SPLITS
    d_mask = offs_d < HEAD_DIM

    m = tl.load(PART_MAX + row * NUM_SPLITS + offs_s, mask=s_mask, other=float("-inf"))   # [SPLITS_PAD]
    sums = tl.load(PART_SUM + row * NUM_SPLITS + offs_s, mask=s_mask, other=0.0)
    acc = tl.load(PART_ACC + (row * NUM_SPLITS + offs_s[:, None]) * HEAD_DIM + offs_d[None, :],
                  mask=s_mask[:, None] & d_mask[None, :], other=0.0)                       # [SPLITS_PAD, HEAD_DIM_PAD]

    m_max = tl.max(m, axis=0)
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)   # every split empty: weights all 0 below
    # NOTE: an empty split has m = -inf; give it weight 0 explicitly rather than trusting exp2(-inf).
    w = tl.where(m == float("-inf"), 0.0, tl.exp2(m - m_max))
    denom = tl.sum(w * sums, axis=0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    out = tl.sum(w[:, None] * acc, axis=0) / denom                                          # [HEAD_DIM_PAD]
    tl.store(OUT + seq * stride_o_seq + head * stride_o_head + offs_d, out.to(OUT.dtype.element_ty), mask=d_mask)


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def pick_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Splits per sequence: enough programs for ~2 per SM, but never splits under MIN_TOKENS_PER_SPLIT."""
    if device.type != "cuda" or triton.knobs.runtime.interpret:
        return 1
    programs = num_seqs * num_kv_heads
    sms = _sm_count(device.index if device.index is not None else torch.cuda.current_device())
    if programs >= sms:
        return 1
    by_occupancy = triton.cdiv(2 * sms, programs)
    by_length = triton.cdiv(max_seq_len, MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def dot_dtype(dtype: torch.dtype) -> tl.dtype:
    """Operand dtype of tl.dot for a cache dtype.

    NOTE: the Triton interpreter does not implement bf16 arithmetic (it multiplies the raw uint16
    bit patterns in tl.dot, triton-lang/triton#11584), so under TRITON_INTERPRET=1 bf16 operands are
    upcast to fp32. On GPU the dots run in the cache dtype.
    """
    if dtype == torch.bfloat16:
        return tl.float32 if triton.knobs.runtime.interpret else tl.bfloat16
    return {torch.float16: tl.float16, torch.float32: tl.float32}[dtype]



def check_paged_inputs(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       block_tables: torch.Tensor, seq_lens: torch.Tensor) -> tuple[int, int, int]:
    """Launcher asserts shared by the paged attention kernels; returns (block_size, num_kv_heads, head_dim)."""
    assert key_cache.dim() == 4 and key_cache.shape == value_cache.shape, \
        "caches must be [num_blocks, block_size, num_kv_heads, head_dim]"
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads, q_dim = q.shape[1], q.shape[2]
    assert q_dim == head_dim and num_heads % num_kv_heads == 0, \
        f"q {tuple(q.shape)} vs cache {tuple(key_cache.shape)}: head_dim must match and heads divide"
    assert q.dtype == key_cache.dtype == value_cache.dtype, \
        f"q {q.dtype} and caches {key_cache.dtype}/{value_cache.dtype} must share a dtype"
    assert q.dtype in (torch.float32, torch.float16, torch.bfloat16)
    assert q.stride(-1) == 1 and key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1, \
        "head_dim must be the contiguous dimension"
    assert block_tables.dtype == torch.int32 and block_tables.dim() == 2 and block_tables.stride(1) == 1
    assert seq_lens.dtype == torch.int32 and seq_lens.is_contiguous()
    assert 1 <= block_size <= 128 and head_dim <= 256
    return block_size, num_kv_heads, head_dim

def check_contiguous_inputs(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                            slot_ids: torch.Tensor, seq_lens: torch.Tensor) -> tuple[int, int]:
    """Launcher asserts shared by the contiguous (vAttention) kernels; returns (num_kv_heads, head_dim)."""
    assert key_cache.dim() == 4 and key_cache.shape == value_cache.shape, \
        "caches must be [num_slots, slot_len, num_kv_heads, head_dim]"
    _, _, num_kv_heads, head_dim = key_cache.shape
    assert q.shape[2] == head_dim and q.shape[1] % num_kv_heads == 0
    assert q.dtype == key_cache.dtype == value_cache.dtype and q.dtype in (torch.float32, torch.float16, torch.bfloat16)
    assert q.stride(-1) == 1 and key_cache.stride(-1) == 1 and value_cache.stride(-1) == 1, \
        "head_dim must be the contiguous dimension"
    assert slot_ids.dtype == torch.int32 and slot_ids.dim() == 1 and slot_ids.is_contiguous()
    assert seq_lens.dtype == torch.int32 and seq_lens.is_contiguous() and seq_lens.shape == slot_ids.shape
    assert head_dim <= 256
    return num_kv_heads, head_dim


def paged_decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, block_tables: torch.Tensor,
                 seq_lens: torch.Tensor, max_seq_len: int, scale: float, num_splits: int | None = None,
                 out: torch.Tensor | None = None) -> torch.Tensor:
    """q [num_seqs, num_heads, head_dim] attends to its whole context (seq_lens incl. itself) -> out."""
    block_size, num_kv_heads, head_dim = check_paged_inputs(q, key_cache, value_cache, block_tables, seq_lens)
    assert seq_lens.shape == (q.shape[0],) and block_tables.shape[0] == q.shape[0]
    return _decode(q, key_cache, value_cache, block_tables, block_tables.stride(0), seq_lens, max_seq_len, scale,
                   block_size, num_kv_heads, head_dim, False, num_splits, out)


def contiguous_decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, slot_ids: torch.Tensor,
                      seq_lens: torch.Tensor, max_seq_len: int, scale: float, num_splits: int | None = None,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """The same attention over a contiguous (vAttention) cache [num_slots, slot_len, Hkv, D]: sequence i's
    context is rows 0 .. seq_lens[i] - 1 of slot slot_ids[i]; no block table."""
    num_kv_heads, head_dim = check_contiguous_inputs(q, key_cache, value_cache, slot_ids, seq_lens)
    return _decode(q, key_cache, value_cache, slot_ids, 1, seq_lens, max_seq_len, scale, 1, num_kv_heads,
                   head_dim, True, num_splits, out)


def _decode(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, table: torch.Tensor,
            stride_table: int, seq_lens: torch.Tensor, max_seq_len: int, scale: float, block_size: int,
            num_kv_heads: int, head_dim: int, contiguous: bool, num_splits: int | None,
            out: torch.Tensor | None) -> torch.Tensor:
    num_seqs, num_heads, _ = q.shape
    if out is None:
        out = torch.empty_like(q)
    assert out.shape == q.shape and out.stride(-1) == 1
    if num_seqs == 0:
        return out
    if num_splits is None:
        num_splits = pick_num_splits(num_seqs, num_kv_heads, max_seq_len, q.device)
    assert num_splits >= 1

    group = num_heads // num_kv_heads
    head_dim_pad = max(16, triton.next_power_of_2(head_dim))
    if num_splits > 1:
        part_acc = torch.empty(num_seqs, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
        part_max = torch.empty(num_seqs, num_heads, num_splits, dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused: the NUM_SPLITS == 1 branch writes OUT directly

    paged_decode_kernel[(num_seqs, num_kv_heads, num_splits)](
        q, key_cache, value_cache, table, seq_lens, out, part_acc, part_max, part_sum,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        key_cache.stride(0), key_cache.stride(1), key_cache.stride(2),
        value_cache.stride(0), value_cache.stride(1), value_cache.stride(2),
        stride_table,
        out.stride(0), out.stride(1),
        GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=block_size, BLOCK_N=TILE_TOKENS,
        NUM_SPLITS=num_splits,
        DOT_DTYPE=dot_dtype(q.dtype), DOT_PRECISION="ieee" if q.dtype == torch.float32 else None,
        CONTIGUOUS=contiguous,
    )
    if num_splits > 1:
        paged_decode_reduce_kernel[(num_seqs, num_heads)](
            part_acc, part_max, part_sum, out,
            out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=num_splits, SPLITS_PAD=triton.next_power_of_2(num_splits),
        )
    return out
