"""CpuAttentionBackend: the CPU path for paged caches, without a copy where a step is memory-bound.

    decode rows (one query token)   the C++ paged decode kernel (kernels/cpu/paged_decode.cpp): K and V
                                    read in place through the block table, every sequence in one call
    prefill chunks                  the C++ paged prefill kernel (kernels/cpu/paged_prefill.cpp): every
                                    chunk of the step in one call, in place, a shared prefix's tiles
                                    walked once for the chunks of every sequence that shares it (cascade)

A mixed step runs both on its rows. A prompt's last token computed alone (the rest hit the prefix cache)
is a prefill chunk of one: it takes the prefill path, so it comes out as it would in a longer chunk.
Caches are float32 or bfloat16 ([num_blocks, block_size, Hkv, D] per layer, as every paged backend); every
product accumulates in float32.

Without the C++ kernels (`kernels` None: not built, or turned off) the decode rows take the torch backend's
path (a gather per step), and the prefill chunks torch's flash attention for the CPU: the chunk's queries
over the sequence's whole context gathered from its blocks (GQA native, causal lower-right).

The batch-invariant mode (`invariant`) runs every row through the decode kernel, prompt rows too (a prompt
token at position p is a decode row over its first p + 1 tokens), with every context cut into splits of
INVARIANT_SPLIT_TOKENS and no cascade: a row's output is then a function of its own query and the K / V of
its own context only, bit for bit, whatever the step holds, however its prompt was chunked, whether its
blocks were computed by a prefill or by decode steps. Prompts attend slower that way (each row reads its
context; measured in the README).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.cpu import paged_decode as cpu_decode
from kernels.cpu.library import CpuKernels
from kernels.metadata import AttentionMetadata
from kernels.torch_backend import TorchAttentionBackend

_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
INVARIANT_SPLIT_TOKENS = 512     # the batch-invariant mode's decode split (tokens; a whole number of blocks)


@dataclass
class _MixedRows:
    """A mixed step's rows (`CpuAttentionBackend._mixed_rows`): the same for every layer of the step."""

    starts: list[int]                                   # query_start_loc
    prefill: list[int]                                  # the sequences with a prompt chunk
    rows: torch.Tensor | None = None                    # the decode rows' positions in q (int64), None: none
    tables: torch.Tensor | None = None                  # their block tables, lengths, the longest
    lens: torch.Tensor | None = None
    max_len: int = 0
    plan: cpu_decode.DecodePlan | None = None           # the decode kernel's plan, where it takes these shapes


class CpuAttentionBackend(TorchAttentionBackend):
    name = "cpu"

    def __init__(self, kernels: CpuKernels | None, invariant: bool = False) -> None:
        self.kernels = kernels
        self.invariant = invariant
        if invariant and kernels is None:
            raise ValueError("the batch-invariant mode needs the C++ CPU kernels")

    @property
    def compiled(self) -> bool:
        return self.kernels is not None

    def _split(self, block_size: int) -> int | None:
        """Blocks a decode split (None: as many splits as keep the threads busy)."""
        return max(1, INVARIANT_SPLIT_TOKENS // block_size) if self.invariant else None

    def _plan(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, rows: torch.Tensor | None,
              block_size: int) -> cpu_decode.DecodePlan:
        """The decode kernel's plan for these rows, once a step (a decode step's or a mixed step's decode rows)."""
        return cpu_decode.plan(block_tables, seq_lens, rows, block_size, cascade=not self.invariant,
                               split_blocks=self._split(block_size))

    def write_kv(self, key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, md: AttentionMetadata) -> None:
        """A step's K / V rows into the cache: the C++ kernel's write where it takes the shapes (the same bits as
        torch's conversion and index_copy but for a NaN's, in one pass: 16 us a layer for 209 rows against torch's
        52, measured on a Zen 4), torch's otherwise."""
        _, block_size, num_kv_heads, head_dim = key_cache.shape
        if self.kernels is not None and key.dtype == value.dtype == torch.float32 and md.kv_rows.dtype == torch.int64 \
                and cpu_decode.supports(num_kv_heads, num_kv_heads, head_dim, block_size, key_cache.dtype):
            self.kernels.decode.write(key, value, key_cache, value_cache, md.kv_rows.contiguous())
            return
        super().write_kv(key_cache, value_cache, key, value, md)

    def decode_plan(self, md: AttentionMetadata, key_cache: torch.Tensor, num_heads: int,
                    head_dim: int) -> cpu_decode.DecodePlan | None:
        """A decode-only step's plan for the fused decode call (made by its first layer, kept in the step's
        scratch for the others), where the kernel takes the shapes; None otherwise."""
        if not md.is_decode_only or self.kernels is None:
            return None
        p = md.scratch.get("cpu_decode_plan")
        if p is None:
            block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
            if not cpu_decode.supports(num_heads, num_kv_heads, head_dim, block_size, key_cache.dtype):
                p = md.scratch["cpu_decode_plan"] = False
            else:
                p = md.scratch["cpu_decode_plan"] = self._plan(md.block_tables, md.seq_lens, md.kv_rows, block_size)
        return p if isinstance(p, cpu_decode.DecodePlan) else None

    def attend(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor, md: AttentionMetadata, scale: float) -> torch.Tensor:
        """A decode step's layer in one C++ call (write K/V, then attend); anything else as write + forward."""
        if q.dtype == key.dtype == torch.float32:
            p = self.decode_plan(md, key_cache, q.shape[1], q.shape[2])
            if p is not None:
                assert self.kernels is not None
                return self.kernels.decode.write_attend(q, key, value, key_cache, value_cache, p, scale)
        return super().attend(q, key, value, key_cache, value_cache, md, scale)

    def forward(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                md: AttentionMetadata, scale: float) -> torch.Tensor:
        # q: [num_tokens, num_heads, head_dim] -> out: [num_tokens, num_heads, head_dim], in q's dtype
        dtype, q = q.dtype, q.float()
        if self.invariant and self.kernels is not None:
            return self._every_row_decodes(q.contiguous(), key_cache, value_cache, md, scale).to(dtype)
        if md.is_decode_only:
            return self._decode_rows(q, key_cache, value_cache, md.block_tables, md.seq_lens, md.max_seq_len, md,
                                scale).to(dtype)
        out = torch.empty_like(q)
        mixed = self._mixed_rows(md, q, key_cache)
        if mixed.rows is not None:
            q_rows = q.index_select(0, mixed.rows)
            if mixed.plan is not None and self.kernels is not None:
                decoded = self.kernels.decode.attend(q_rows, key_cache, value_cache, mixed.plan, scale)
            else:
                assert mixed.tables is not None and mixed.lens is not None
                decoded = self._decode_rows(q_rows, key_cache, value_cache, mixed.tables, mixed.lens, mixed.max_len,
                                            None, scale)
            out.index_copy_(0, mixed.rows, decoded)
        prefill = mixed.prefill
        if self.kernels is not None and self.kernels.prefill.prefill(
                q, key_cache, value_cache, md.block_tables, md.seq_lens, md.query_start_loc, prefill, scale, out,
                cascade=True) is not None:
            return out.to(dtype)
        block_size = key_cache.shape[1]
        for i in prefill:
            seq_len = md.seq_lens_list[i]
            nb = -(-seq_len // block_size)
            blocks = md.block_tables[i, :nb].long()
            k = key_cache[blocks].flatten(0, 1)[:seq_len].float()          # [seq_len, Hkv, D]
            v = value_cache[blocks].flatten(0, 1)[:seq_len].float()
            s, e = mixed.starts[i], mixed.starts[i + 1]
            out[s:e] = extend_attention(q[s:e], k, v, scale)
        return out.to(dtype)

    def _mixed_rows(self, md: AttentionMetadata, q: torch.Tensor, key_cache: torch.Tensor) -> _MixedRows:
        """A mixed step's rows, made by its first layer and kept in the step's scratch for the others: the prompt
        chunks, the decode rows' positions in q, their tables and lengths, and the decode kernel's work plan
        (numpy, ~0.2 ms for 40 sequences here: once a step, not once a layer)."""
        mixed = md.scratch.get("cpu_mixed_rows")
        if mixed is not None:
            return mixed
        starts = md.query_start_loc.tolist()
        decode = [i for i in range(md.num_seqs) if not md.is_prefill(i)]
        prefill = [i for i in range(md.num_seqs) if md.is_prefill(i)]
        mixed = _MixedRows(starts, prefill)
        if decode:
            index = torch.tensor(decode, dtype=torch.long)
            block_size = key_cache.shape[1]
            mixed.rows = torch.tensor([starts[i] for i in decode], dtype=torch.long)
            mixed.tables = md.block_tables.index_select(0, index).contiguous()
            mixed.lens = md.seq_lens.index_select(0, index).contiguous()
            mixed.max_len = max(md.seq_lens_list[i] for i in decode)
            if self.kernels is not None and cpu_decode.supports(q.shape[1], key_cache.shape[2], q.shape[2],
                                                                block_size, key_cache.dtype):
                mixed.plan = self._plan(mixed.tables, mixed.lens, None, block_size)
        md.scratch["cpu_mixed_rows"] = mixed
        return mixed

    def _decode_rows(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int,
                     md: AttentionMetadata | None, scale: float) -> torch.Tensor:
        num_heads, head_dim = q.shape[1], q.shape[2]
        block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
        if self.kernels is not None and cpu_decode.supports(num_heads, num_kv_heads, head_dim, block_size,
                                                            key_cache.dtype):
            return self.kernels.decode.decode(q, key_cache, value_cache, block_tables.contiguous(), seq_lens, scale,
                                              cascade=not self.invariant, split_blocks=self._split(block_size))
        if md is None:
            md = _decode_metadata(block_tables, seq_lens, max_seq_len)
        return super()._decode(q, key_cache, value_cache, md, scale)


    def _every_row_decodes(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                           md: AttentionMetadata, scale: float) -> torch.Tensor:
        """The batch-invariant mode: token j of sequence i, at position p, attends as a decode row of a sequence
        of p + 1 tokens with i's block table (K / V of the step already written)."""
        assert self.kernels is not None
        rows = md.scratch.get("invariant_rows")
        if rows is None:
            seq_of_token = torch.repeat_interleave(torch.arange(md.num_seqs), torch.tensor(md.query_lens_list))
            starts = md.query_start_loc.long()[:-1][seq_of_token]
            first = (md.seq_lens.long() - torch.tensor(md.query_lens_list))[seq_of_token]
            lens = (first + torch.arange(q.shape[0]) - starts + 1).to(torch.int32)        # [T]: p + 1
            rows = md.scratch["invariant_rows"] = (md.block_tables.index_select(0, seq_of_token).contiguous(), lens)
        tables, lens = rows
        return self.kernels.decode.decode(q, key_cache, value_cache, tables, lens, scale, cascade=False,
                                          split_blocks=self._split(key_cache.shape[1]))


Q_TILE = 32         # the CPU flash kernel's query block for short queries
MIN_TAIL = 4        # a last query block of fewer rows is computed another way (measured on torch 2.13)


def extend_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, D]: the last n positions of a sequence whose keys / values are k, v [L, Hkv, D] (L >= n)
    -> [n, H, D]. Query j sits at position L - n + j and sees positions <= its own.

    NOTE: one flash call over the whole context (GQA native). A whole prompt (n == L) is top-left causal,
    which lets the kernel skip the masked tiles; a chunk over a cached context gets its lower-right mask
    written out. Each query row then comes out bit-identical however the prompt was cut into chunks, as
    long as its context has the same length (tested): a request that hits the blocks another request
    computed gets the answer it would have computed itself. The kernel computes the rows of a last query
    block of 1-3 rows another way, so such a block is padded with copies of the last row (dropped after).
    (Attending to the cached context and to the chunk apart, merged by log-sum-exp, would need no mask but
    rounds differently for every split point.)"""
    n, length, num_heads, head_dim = q.shape[0], k.shape[0], q.shape[1], q.shape[2]
    tail = n % Q_TILE
    pad = MIN_TAIL - tail if 0 < tail < MIN_TAIL else 0
    if pad:
        q = torch.cat([q, q[-1:].expand(pad, num_heads, head_dim)])
    qh, kh, vh = q.transpose(0, 1).unsqueeze(0), k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)
    if n == length:     # top-left causal: the padded rows past the end see every key (and are dropped)
        out, _ = _flash(qh, kh, vh, 0.0, True, scale=scale)
    else:
        pos = torch.arange(length - n, length)
        if pad:
            pos = torch.cat([pos, pos.new_full((pad,), length - 1)])
        mask = torch.zeros(n + pad, length, dtype=q.dtype).masked_fill_(
            torch.arange(length)[None, :] > pos[:, None], float("-inf"))
        out, _ = _flash(qh, kh, vh, 0.0, False, attn_mask=mask[None, None], scale=scale)
    return out[0, :, :n].transpose(0, 1)


def _decode_metadata(block_tables: torch.Tensor, seq_lens: torch.Tensor, max_seq_len: int) -> AttentionMetadata:
    n = seq_lens.shape[0]
    return AttentionMetadata(kv_rows=torch.zeros(n, dtype=torch.long), block_tables=block_tables, seq_lens=seq_lens,
                             query_start_loc=torch.arange(n + 1, dtype=torch.int32),
                             seq_lens_list=seq_lens.tolist(), query_lens_list=[1] * n, max_query_len=1,
                             max_seq_len=max_seq_len)


__all__ = ["CpuAttentionBackend", "extend_attention"]
