"""AttentionMetadata: the flattened batch layout every attention backend reads.

Token regions of one sequence in a step (its query is the `new` part):

    | computed (in cache, maybe shared) | new (this step's query tokens) |
    0                         seq_len - query_len                  seq_len

Tokens of all sequences are concatenated without padding; sequence i owns rows
query_start_loc[i] : query_start_loc[i + 1] of q / k / v.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class AttentionMetadata:
    kv_rows: torch.Tensor          # [num_tokens] int64: the cache row each new token's K/V goes to: block_id *
                                   # block_size + offset (paged); slot * slot_len + position (contiguous)
                                   # (vLLM's "slot_mapping"; here "slot" means only a vAttention slot)
    block_tables: torch.Tensor     # [num_seqs, max_blocks] int32, rows padded with 0 past the sequence's blocks
                                   # (paged; [num_seqs, 0] for contiguous caches)
    seq_lens: torch.Tensor         # [num_seqs] int32: context length including this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32: prefix sums of query lengths
    seq_lens_list: list[int]       # host copies, so backends need no device sync
    query_lens_list: list[int]
    max_query_len: int
    max_seq_len: int
    slot_ids: torch.Tensor | None = None   # [num_seqs] int32: each sequence's slot (contiguous caches only)
    prefill_list: list[bool] | None = None   # per sequence: its chunk computes prompt tokens (None: query_len > 1)
    scratch: dict[str, Any] = field(default_factory=dict, repr=False)  # per-step values a backend derives once

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_list)

    @property
    def is_decode_only(self) -> bool:
        return self.max_query_len == 1 and not any(self.prefill_list or ())

    def is_prefill(self, i: int) -> bool:
        """Sequence i computes prompt tokens this step (a one-token chunk may: the last prompt token
        of a request whose other tokens all hit the prefix cache)."""
        return self.query_lens_list[i] > 1 or bool(self.prefill_list and self.prefill_list[i])
