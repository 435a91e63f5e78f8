"""vAttention vs the paged KV backend on the same work: decode step time and prefill throughput at several
context lengths and batch sizes, memory waste per request, and page-mapping stalls.

    prefixserve bench vattention [--quick] [--model M] [--out DIR]

For each (batch size B, context C) both backends, in alternating order, prefill B distinct random
prompts of C tokens (timed: prefill tokens per second) and then decode `--decode-steps` tokens per
sequence (timed per step: the median step). One engine per backend, built once, same model, same
block size, prefix caching on (no hits: the prompts are distinct). Ratios are vattention / paged of the
medians: below 1 is faster for decode step time, above 1 faster for prefill throughput.

Also measured in the same run: the time of one page mapping (mmap MAP_FIXED of a memfd page), the
pages mapped synchronously during the timed decode steps (decode stalls: the goal is 0 after warm-up),
and the memory each request wastes at this page size (allocated pages x page tokens - tokens held,
sampled every step), next to what GPU page sizes would waste for the same model.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from typing import Any

import numpy as np
from tqdm import tqdm

from benchmarks.common import (
    add_common_args,
    command_line,
    new_figure,
    print_result,
    random_prompts,
    setup_torch,
    write_results,
)
from engine import LLM, SamplingParams
from engine.kv.backends.vattention.cache import VAttentionCache
from engine.kv.backends.vattention.vmm import HostVirtualMemory

BACKENDS = ("paged", "vattention")


def measure(llm: LLM, prompts: list[list[int]], steps: int) -> dict[str, Any]:
    """Prefill the prompts in one step budget, then decode `steps` tokens each; per-step timings."""
    engine = llm.engine
    core = engine.core
    before = {k: s.value for k, s in core.stats().kv_backend_stats.items()}
    params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
    rids = [f"b{time.perf_counter_ns()}-{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts):
        engine.add_request(rid, p, params)
    prefill_t, decode_t, waste = 0.0, [], []
    t = time.perf_counter()
    while engine.has_unfinished():
        decoding = all(s.num_computed >= s.num_prompt_tokens for s in core.scheduler.running) and \
            not core.scheduler.waiting
        engine.step()
        now = time.perf_counter()
        if decoding:
            decode_t.append(now - t)
        else:
            prefill_t += now - t
        held = [(core.manager.num_blocks(s.seq_id), s.num_computed) for s in core.scheduler.running
                if core.manager.has(s.seq_id)]
        if held:
            waste.append(statistics.mean(b * core.block_size - n for b, n in held))
        t = time.perf_counter()
    after = {k: s.value for k, s in core.stats().kv_backend_stats.items()}
    out: dict[str, Any] = {"prefill_tok_s": sum(map(len, prompts)) / prefill_t,
                           "decode_step_ms": 1000 * statistics.median(decode_t), "waste_tokens": statistics.mean(waste)}
    if after:                                   # the vattention backend's counters
        out |= {k: after[k] - before[k] for k in ("decode_stalls", "sync_maps", "ahead_maps")}
    return out


def map_latency_us(page_bytes: int, n: int = 2000) -> float:
    vm = HostVirtualMemory(num_pages=64, page_bytes=page_bytes)
    base = vm.reserve(n * page_bytes)
    t = time.perf_counter()
    for i in range(n):
        vm.map(base + i * page_bytes, i % 64)
    return (time.perf_counter() - t) / n * 1e6


def main(argv: list[str] | None = None, prog: str = "prefixserve bench vattention") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--batches", type=int, nargs="+", help="batch sizes (default 1 8 16; --quick: 1 8)")
    ap.add_argument("--contexts", type=int, nargs="+", help="context lengths (default 256 1024 2048; quick: 256 1024)")
    ap.add_argument("--decode-steps", type=int, help="timed decode steps (default 16; --quick: 12)")
    ap.add_argument("--rounds", type=int, help="rounds per point (default 2; --quick: 1)")
    args = ap.parse_args(argv)
    defaults = ([1, 8], [256, 1024], 12, 1) if args.quick else ([1, 8, 16], [256, 1024, 2048], 16, 2)
    for name, value in zip(("batches", "contexts", "decode_steps", "rounds"), defaults):
        if getattr(args, name) is None:
            setattr(args, name, value)
    setup_torch(args)
    max_len = max(args.contexts) + args.decode_steps + 16
    blocks = max(args.batches) * (max_len // 16 + 2) + 64
    llms = {b: LLM(args.model, device=args.device, dtype=args.dtype, kv_backend=b, max_model_len=max_len,
                   num_kv_blocks=blocks, max_num_seqs=max(args.batches), max_num_batched_tokens=4096)
            for b in BACKENDS}
    core = llms["vattention"].engine.core
    cache = core.kv_cache
    assert isinstance(cache, VAttentionCache) and core.block_size == llms["paged"].engine.core.block_size
    vocab = core.vocab_size
    warm = random_prompts([min(64, *args.contexts)] * 4, vocab, args.seed + 99)
    for llm in llms.values():                                  # warm-up: first steps, first mappings
        measure(llm, warm, 4)
    rows: list[dict[str, Any]] = []
    points = [(b, c) for b in args.batches for c in args.contexts]
    for i, (batch, ctx) in enumerate(tqdm(points, desc="vattention")):
        per: dict[str, list[dict[str, Any]]] = {b: [] for b in BACKENDS}
        for r in range(args.rounds):
            prompts = random_prompts([ctx] * batch, vocab, args.seed + 1000 * i + r)
            order = BACKENDS if (i + r) % 2 == 0 else BACKENDS[::-1]
            for b in order:
                per[b].append(measure(llms[b], prompts, args.decode_steps))
        row: dict[str, Any] = {"batch": batch, "context": ctx}
        for b in BACKENDS:
            for key in ("prefill_tok_s", "decode_step_ms", "waste_tokens"):
                row[f"{b}_{key}"] = statistics.median(m[key] for m in per[b])
        row["decode_ratio"] = row["vattention_decode_step_ms"] / row["paged_decode_step_ms"]
        row["prefill_ratio"] = row["vattention_prefill_tok_s"] / row["paged_prefill_tok_s"]
        row["decode_stalls"] = sum(m["decode_stalls"] for m in per["vattention"])
        row["ahead_maps"] = sum(m["ahead_maps"] for m in per["vattention"])
        rows.append(row)

    args_m = core.loaded.args
    token_bytes = cache.page_bytes // cache.block_size
    per_layer_row = token_bytes // (2 * args_m.num_layers)
    map_us = map_latency_us(cache.page_bytes)
    waste = statistics.mean(r["vattention_waste_tokens"] for r in rows)
    gpu = {f"{kib} KiB": kib * 1024 // per_layer_row for kib in (64, 2048)}    # tokens per per-layer GPU page
    result = {"rows": rows, "block_size": cache.block_size, "page_bytes": cache.page_bytes,
              "map_us_per_page": map_us, "decode_stalls_after_warmup": sum(r["decode_stalls"] for r in rows),
              "decode_ratio_median": statistics.median(r["decode_ratio"] for r in rows),
              "prefill_ratio_median": statistics.median(r["prefill_ratio"] for r in rows),
              "waste_tokens_per_request": waste, "waste_kib_per_request": waste * token_bytes / 1024,
              "gpu_page_tokens": gpu}
    lines = ["| batch | context | decode step ms paged | vattention | vatt / paged | prefill tok/s paged | "
             "vattention | vatt / paged | decode stalls | pages mapped ahead |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['batch']} | {r['context']} | {r['paged_decode_step_ms']:.1f} | "
                     f"{r['vattention_decode_step_ms']:.1f} | {r['decode_ratio']:.2f} | "
                     f"{r['paged_prefill_tok_s']:.0f} | {r['vattention_prefill_tok_s']:.0f} | "
                     f"{r['prefill_ratio']:.2f} | {r['decode_stalls']} | "
                     f"{r['ahead_maps']} |")
    table = "\n".join(lines) + (
        f"\n\nMedians: decode step vattention / paged **{result['decode_ratio_median']:.2f}**, prefill throughput "
        f"vattention / paged **{result['prefill_ratio_median']:.2f}** ({args.rounds} round(s) per point, backends "
        f"alternating). Page: {cache.block_size} tokens x every layer's K and V = {cache.page_bytes // 1024} KiB; "
        f"one mapping (mmap MAP_FIXED of a memfd page) {map_us:.1f} us. Decode stalls (a decode waiting for a "
        f"page mapping) after warm-up: {result['decode_stalls_after_warmup']}. Waste: "
        f"{waste:.1f} tokens per running request ({result['waste_kib_per_request']:.0f} KiB; the paged backend "
        f"wastes {statistics.mean(r['paged_waste_tokens'] for r in rows):.1f}), the partial last page plus pages "
        f"mapped ahead. With the paper's per-layer pages on a GPU this model would hold "
        + ", ".join(f"{v} tokens per {k} page" for k, v in gpu.items()) + " (up to that many tokens wasted per "
        "request per layer).")
    fig, (ax1, ax2) = new_figure(2)
    for batch in args.batches:
        sel = [r for r in rows if r["batch"] == batch]
        ax1.plot([r["context"] for r in sel], [r["decode_ratio"] for r in sel], "o-", label=f"batch {batch}")
        ax2.plot([r["context"] for r in sel], [r["prefill_ratio"] for r in sel], "o-", label=f"batch {batch}")
    for ax, what in ((ax1, "decode step time"), (ax2, "prefill throughput")):
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context tokens")
        ax.set_ylabel(f"{what}: vattention / paged")
        ax.legend()
    write_results("vattention", table, {"result": result}, args.out, fig, command_line(prog, argv))
    print_result({k: v for k, v in result.items() if k != "rows"})
    return 0 if np.isfinite(result["decode_ratio_median"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
