"""Builds one flattened batch per step (no padding), runs the model, and returns the logits of the rows that sample.

Per step the runner builds, with numpy rather than per-token Python loops:
  input_ids [T], positions [T], kv_rows [T], seq_lens [S], query_start_loc [S + 1], and
  logits_indices [N]: the last token of each sequence that samples; the KV cache adds where the tokens
  live (engine/kv/backends/base.Addressing): block_tables [S, max_blocks] (paged) or slot_ids [S] (vAttention).
The block tables are rows of a persistent array updated in place with what changed (block_table.py).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from engine.kv.backends.base import KVStore
from engine.kv.block_manager import BlockManager
from engine.models.llama import LlamaForCausalLM
from engine.sched.scheduler import ScheduledSeq
from engine.worker.block_table import BlockTables
from engine.worker.compiled_decode import CompiledDecode
from kernels import Attention, AttentionMetadata

log = logging.getLogger(__name__)


@dataclass
class StepLogits:
    sample: torch.Tensor                 # [N, V]: one row per sampling sequence
    extra: torch.Tensor | None = None    # [R, V]: the extra rows asked for, in order


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, kv_cache: KVStore, backend: Attention,
                 device: str | torch.device, manager: BlockManager) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.tables = BlockTables(manager)
        self.backend = backend
        self.device = torch.device(device)
        self.compiled: CompiledDecode | None = None      # set by compile_decode()

    def compile_decode(self, max_num_seqs: int) -> float:
        """Compiles the decode step for every batch bucket; the seconds it took. A failure leaves the
        runner eager (logged, and kept in `compiled.failed`)."""
        self.compiled = CompiledDecode(self.model, max_num_seqs)
        key, value = self.kv_cache.layers()
        try:
            return self.compiled.warm_up(key, value, self.backend)
        except Exception as exc:  # noqa: BLE001 - whatever the compiler raises, eager still serves
            self.compiled.failed = f"{type(exc).__name__}: {exc}"
            log.error("compiling the decode step failed; decoding eagerly: %s", self.compiled.failed, exc_info=True)
            return 0.0

    def prepare(self, batch: list[ScheduledSeq]) -> tuple[
            torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        query_lens = [s.num_new for s in batch]
        starts = [s.seq.num_computed for s in batch]
        seq_lens = [st + q for st, q in zip(starts, query_lens)]
        ids: list[int] = []
        for s, st, q in zip(batch, starts, query_lens):
            ids.extend(s.seq.token_ids[st:st + q])
        qsl = np.zeros(len(batch) + 1, dtype=np.int64)
        np.cumsum(query_lens, out=qsl[1:])
        total = int(qsl[-1])
        # position of every token: its sequence's start plus its offset within the chunk
        seq_of_token = np.repeat(np.arange(len(batch)), query_lens)
        positions = np.asarray(starts, dtype=np.int64)[seq_of_token] + (np.arange(total) - qsl[:-1][seq_of_token])
        decoding = [s.seq.num_computed >= s.seq.num_prompt_tokens for s in batch]
        seq_ids = [s.seq.seq_id for s in batch]
        where = self.kv_cache.addressing(seq_ids, self.tables.step(seq_ids), seq_lens, seq_of_token, positions,
                                         decoding)
        logits_indices = [int(qsl[i + 1]) - 1 for i, s in enumerate(batch) if s.sample]
        dev = self.device
        tables = where.block_tables if where.block_tables is not None else np.zeros((len(batch), 0), np.int32)
        md = AttentionMetadata(
            kv_rows=torch.from_numpy(where.kv_rows).to(dev),
            block_tables=torch.from_numpy(tables).to(dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens_list=seq_lens,
            query_lens_list=query_lens,
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            slot_ids=None if where.slot_ids is None else torch.tensor(where.slot_ids, dtype=torch.int32, device=dev),
            prefill_list=[not d for d in decoding],
        )
        return (torch.tensor(ids, dtype=torch.long, device=dev), torch.from_numpy(positions).to(dev), md,
                torch.tensor(logits_indices, dtype=torch.long, device=dev))

    @torch.inference_mode()
    def execute(self, batch: list[ScheduledSeq], copies: list[tuple[int, int]],
                extra_rows: list[int] | None = None) -> StepLogits:
        """Runs one step: float32 logits [N, V] for the sequences with `sample` set, in order, and for
        `extra_rows` (rows of the flattened batch: prompt positions whose log-probabilities were asked)."""
        self.kv_cache.copy_blocks(copies)
        input_ids, positions, md, logits_indices = self.prepare(batch)
        key, value = self.kv_cache.layers()
        hidden = None
        if self.compiled is not None and self.compiled.fits(md):
            try:
                hidden = self.compiled(input_ids, positions, key, value, md, self.backend)
            except Exception as exc:  # noqa: BLE001 - rerun eagerly: the K/V rows it wrote are rewritten the same
                self.compiled.failed = f"{type(exc).__name__}: {exc}"
                log.error("the compiled decode step failed; decoding eagerly from now on: %s", self.compiled.failed,
                          exc_info=True)
        if hidden is None:
            hidden = self.model(input_ids, positions, key, value, md, self.backend)
        extra = None
        if extra_rows:
            extra = self.model.compute_logits(hidden[torch.tensor(extra_rows, dtype=torch.long, device=self.device)])
        return StepLogits(self.model.compute_logits(hidden[logits_indices]), extra)
