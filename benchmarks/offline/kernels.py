"""Benchmark of the paged attention kernels: on a GPU, the Triton kernels against contiguous SDPA on the same
data; on the CPU (`--device cpu`), the C++ kernels of every build this CPU runs (portable, avx2,
avx512, ...: kernels/cpu/library.py) against each other and against torch's fallbacks.

    python benchmarks/offline/kernels.py                 # full sweep, ~a few minutes on an H100
    python benchmarks/offline/kernels.py --quick         # batch {1, 32} x context {1K, 16K}, fewer prefill shapes
    prefixserve bench kernels --device cpu --quick       # the C++ CPU kernels, SmolLM2's attention shapes

CPU: SmolLM2-135M's shapes (9 query heads, 3 KV heads, head_dim 64, bf16 cache, block size 16, shuffled
blocks); decode for batch x context (one layer's call, median wall time of repeated calls, torch's threads), and
16 sequences decoding after a shared 3,072-token prefix (the cascade; on an AMX build, AMX tiles);
prefill steps (16 sequences' 64-token chunks over a shared 3,072- or 8,192-token cached prefix, a cold
1,024-token prompt; `--quick`: the 3,072 one) with and without cascade, and the K / V bytes each reads;
the logits reductions (logsumexp + argmax, top-64) over [64, 49152] float32; the fused elementwise ops over 64
rows (silu_mul [64, 2 x 1536], add_rms_norm [64, 576]). Every build's decode is checked against the torch
fallback before it is timed. Writes benchmarks/results/kernels_cpu.md and .json.

Llama-3-8B-like attention: 32 query heads, 8 KV heads, head_dim 128, bf16, block size 16, blocks of
each sequence scattered at random over the cache (as after a while of serving).

Decode, for batch x context: kernel time (CUDA events, median over many runs, L2 flushed before each
run by writing a buffer larger than L2), achieved bandwidth = K/V bytes read / time, that as a share
of the device copy bandwidth measured in the same run (device-to-device copy, bytes read + written),
and SDPA time on contiguous [batch, heads, context, head_dim] K/V (enable_gqa) over Triton time.
Prefill, for prefix-hit shapes (cached prefix + new tokens): the same against SDPA with a
lower-right causal mask on contiguous K/V. Every configuration is checked against SDPA before timing.

Prints markdown tables; writes benchmarks/results/kernels_<device>.md and .json.
"""
from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import triton
from torch.nn.attention.bias import causal_lower_right
from tqdm import tqdm

# Run as a script, this file's own directory heads sys.path and its name `kernels` would shadow the
# package: put the repository root first.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from kernels.paged_decode import paged_decode, pick_num_splits  # noqa: E402
from kernels.paged_prefill import paged_prefill  # noqa: E402

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16
RESULTS = Path(__file__).resolve().parents[1] / "results"
FLUSH_BYTES = 512 << 20   # > L2 of every current datacenter GPU (H100: 50 MB, B200: 126 MB)


def time_ms(fn: Callable[[], object], flush: torch.Tensor, iters: int) -> float:
    """Median time of fn in ms over `iters` runs, L2 flushed before each."""
    fn()  # warm-up: compile / autotune / allocator
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for start, end in zip(starts, ends):
        flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))


def copy_bandwidth_gbps(flush: torch.Tensor) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = time_ms(lambda: dst.copy_(src), flush, 30)
    return 2 * src.numel() / (ms * 1e-3) / 1e9  # read + written


def paged_cache(seq_lens: list[int], gen: torch.Generator):
    """Random K/V per sequence, scattered over shuffled blocks; also the contiguous copies for SDPA."""
    blocks_per_seq = [math.ceil(s / BLOCK_SIZE) for s in seq_lens]
    num_blocks = sum(blocks_per_seq)
    perm = torch.randperm(num_blocks, generator=gen).cuda()
    max_blocks = max(blocks_per_seq)
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32, device="cuda")
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    key_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    value_cache = torch.randn(shape, dtype=DTYPE, device="cuda")
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = perm[used:used + n].int()
        used += n
    # Contiguous [batch, kv_heads, len, head_dim] views for SDPA (sequences of equal length here).
    contiguous = []
    for cache in (key_cache, value_cache):
        rows = cache[tables.long()].flatten(1, 2)[:, :max(seq_lens)]   # [batch, len, kv_heads, head_dim]
        contiguous.append(rows.transpose(1, 2).contiguous())
    return key_cache, value_cache, tables, contiguous[0], contiguous[1]


def bench_decode(batch: int, context: int, flush: torch.Tensor, copy_gbps: float, gen: torch.Generator) -> dict:
    key_cache, value_cache, tables, k, v = paged_cache([context] * batch, gen)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    scale = HEAD_DIM ** -0.5
    splits = pick_num_splits(batch, NUM_KV_HEADS, context, q.device)

    def triton_fn():
        return paged_decode(q, key_cache, value_cache, tables, seq_lens, context, scale)

    def sdpa_fn():
        return torch.nn.functional.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale, enable_gqa=True)

    torch.testing.assert_close(triton_fn(), sdpa_fn()[:, :, 0], atol=2e-2, rtol=2e-2)
    kv_bytes = 2 * batch * context * NUM_KV_HEADS * HEAD_DIM * key_cache.element_size()
    iters = 100 if kv_bytes < (1 << 30) else 25
    t_ms = time_ms(triton_fn, flush, iters)
    s_ms = time_ms(sdpa_fn, flush, iters)
    gbps = kv_bytes / (t_ms * 1e-3) / 1e9
    return dict(batch=batch, context=context, splits=splits, triton_us=t_ms * 1e3, gbps=gbps,
                copy_share=gbps / copy_gbps, sdpa_us=s_ms * 1e3, sdpa_gbps=kv_bytes / (s_ms * 1e-3) / 1e9,
                sdpa_over_triton=s_ms / t_ms)


def bench_prefill(batch: int, prefix: int, new: int, flush: torch.Tensor, gen: torch.Generator) -> dict:
    context = prefix + new
    key_cache, value_cache, tables, k, v = paged_cache([context] * batch, gen)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    qsl = torch.arange(0, (batch + 1) * new, new, dtype=torch.int32, device="cuda")
    q = torch.randn(batch * new, NUM_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
    scale = HEAD_DIM ** -0.5
    group = NUM_HEADS // NUM_KV_HEADS
    # SDPA's lower-right causal bias handles the prefix; K/V expanded to all heads for it.
    k_full = k.repeat_interleave(group, dim=1)
    v_full = v.repeat_interleave(group, dim=1)
    q_sdpa = q.view(batch, new, NUM_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    bias = causal_lower_right(new, context)

    def triton_fn():
        return paged_prefill(q, key_cache, value_cache, tables, seq_lens, qsl, new, scale)

    def sdpa_fn():
        return torch.nn.functional.scaled_dot_product_attention(q_sdpa, k_full, v_full, attn_mask=bias, scale=scale)

    expected = sdpa_fn().transpose(1, 2).reshape(batch * new, NUM_HEADS, HEAD_DIM)
    torch.testing.assert_close(triton_fn(), expected, atol=2e-2, rtol=2e-2)
    t_ms = time_ms(triton_fn, flush, 50)
    s_ms = time_ms(sdpa_fn, flush, 50)
    visible = batch * sum(prefix + j + 1 for j in range(new))       # (query, key) pairs computed
    flops = 4 * visible * NUM_HEADS * HEAD_DIM                        # QK^T and PV, 2 flops per MAC
    return dict(batch=batch, prefix=prefix, new=new, triton_us=t_ms * 1e3, tflops=flops / (t_ms * 1e-3) / 1e12,
                sdpa_us=s_ms * 1e3, sdpa_over_triton=s_ms / t_ms)


def markdown(device: str, copy_gbps: float, decode: list[dict], prefill: list[dict]) -> str:
    lines = [f"# Paged attention kernels on {device}", "",
             f"torch {torch.__version__}, triton {triton.__version__}; {NUM_HEADS} q heads, {NUM_KV_HEADS} KV heads, "
             f"head_dim {HEAD_DIM}, {str(DTYPE).removeprefix('torch.')}, block size {BLOCK_SIZE}, shuffled blocks. "
             f"Median of CUDA-event timings, L2 flushed before each run. Device copy bandwidth (read + write): "
             f"{copy_gbps:.0f} GB/s.", "",
             "## Decode (one query token per sequence)", "",
             "| batch | context | splits | Triton µs | K/V GB/s | % of copy BW | SDPA µs | SDPA GB/s | SDPA / Triton |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in decode:
        lines.append(f"| {r['batch']} | {r['context']} | {r['splits']} | {r['triton_us']:.1f} | {r['gbps']:.0f} | "
                     f"{100 * r['copy_share']:.0f}% | {r['sdpa_us']:.1f} | {r['sdpa_gbps']:.0f} | "
                     f"{r['sdpa_over_triton']:.2f}x |")
    lines += ["", "## Prefill over a cached prefix", "",
              "| batch | cached prefix | new tokens | Triton µs | TFLOP/s | SDPA µs | SDPA / Triton |",
              "|---:|---:|---:|---:|---:|---:|---:|"]
    for r in prefill:
        lines.append(f"| {r['batch']} | {r['prefix']} | {r['new']} | {r['triton_us']:.1f} | {r['tflops']:.1f} | "
                     f"{r['sdpa_us']:.1f} | {r['sdpa_over_triton']:.2f}x |")
    lines.append("")
    return "\n".join(lines)


def cpu_time_us(fn: Callable[[], object], iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e6


CPU_HEADS, CPU_KV_HEADS, CPU_HEAD_DIM, CPU_BLOCK = 9, 3, 64, 16     # SmolLM2-135M's attention


def cpu_decode_row(batch: int, context: int, variants: list[str], gen: torch.Generator, shared: int = 0) -> dict:
    """One layer's decode call at batch x context: torch's fallback and every build, checked, then timed. shared:
    the first tokens (whole blocks) every sequence's table has in common (a shared system prompt: the kernel's
    cascade reads them once for all, and on an AMX build its items of 16 rows or more take AMX tiles)."""
    from kernels.cpu import paged_decode as cpu_decode
    from kernels.cpu.library import load
    from kernels.cpu.paged_prefill import BF16_PATHS
    from kernels.cpu_backend import CpuAttentionBackend
    from kernels.metadata import AttentionMetadata

    heads, kv_heads, head_dim, block = CPU_HEADS, CPU_KV_HEADS, CPU_HEAD_DIM, CPU_BLOCK
    scale = head_dim ** -0.5
    nb = -(-context // block)
    tables = torch.randperm(batch * nb, generator=gen).int().view(batch, nb).contiguous()
    tables[:, :shared // block] = tables[0, :shared // block]
    kc = torch.randn(batch * nb, block, kv_heads, head_dim, generator=gen).bfloat16()
    vc = torch.randn(batch * nb, block, kv_heads, head_dim, generator=gen).bfloat16()
    q = torch.randn(batch, heads, head_dim, generator=gen)
    lens = torch.full((batch,), context, dtype=torch.int32)
    md = AttentionMetadata(kv_rows=torch.zeros(batch, dtype=torch.long), block_tables=tables, seq_lens=lens,
                           query_start_loc=torch.arange(batch + 1, dtype=torch.int32), seq_lens_list=[context] * batch,
                           query_lens_list=[1] * batch, max_query_len=1, max_seq_len=context)
    fallback = CpuAttentionBackend(None)
    want = fallback.forward(q, kc, vc, md, scale)
    iters = 20 if batch * context <= 32768 else 5
    row = {"batch": batch, "context": context, "shared": shared // block * block,
           "torch_us": cpu_time_us(lambda: fallback.forward(q, kc, vc, md, scale), iters)}
    p = cpu_decode.plan(tables, lens, None, block)
    out = torch.empty_like(q)
    for v in variants:
        k = load(v)
        # the kernel's criterion (kernels/cpu/paged_decode.py): bf16 products within 0.5% of the largest |V|,
        # float32 ones within float32 rounding
        tol = ({"atol": 0.005 * vc.float().abs().max().item(), "rtol": 0.0}
               if k.decode.path in BF16_PATHS else {"atol": 2e-4, "rtol": 2e-4})
        torch.testing.assert_close(k.decode.decode(q, kc, vc, tables, lens, scale), want, **tol)
        row[f"{v}_us"] = cpu_time_us(lambda k=k: k.decode._call(q, None, None, kc, vc, p, scale, out), iters)
    return row


# Prefill steps (sequences, cached shared prefix, new tokens a sequence): the shared system prompt with distinct
# questions (the suffix prefills of a step attend over the same prefix blocks), and a cold prompt.
CPU_PREFILL = [(16, 3072, 64), (16, 8192, 64), (1, 0, 1024)]
CPU_PREFILL_QUICK = [(16, 3072, 64)]


def cpu_prefill_row(seqs: int, prefix: int, new: int, variants: list[str], gen: torch.Generator) -> dict:
    """One layer's prefill attention for `seqs` chunks of `new` tokens over a shared cached `prefix` (the same
    block ids in every table): torch's flash fallback (a gather of each sequence's context, then flash
    attention) and every build with and without cascade, checked against the fallback, then timed. Also the
    K / V bytes each reads (per layer) and the least any can read: the prefix and each suffix once."""
    from kernels.cpu.library import load
    from kernels.cpu.paged_prefill import BF16_PATHS, I16_PATHS
    from kernels.cpu_backend import CpuAttentionBackend
    from kernels.metadata import AttentionMetadata

    heads, kv_heads, head_dim, block = CPU_HEADS, CPU_KV_HEADS, CPU_HEAD_DIM, CPU_BLOCK
    scale = head_dim ** -0.5
    context = prefix + new
    shared, own = prefix // block, -(-new // block)
    perm = torch.randperm(shared + seqs * own, generator=gen).int()
    tables = torch.stack([torch.cat([perm[:shared], perm[shared + i * own:shared + (i + 1) * own]])
                          for i in range(seqs)]).contiguous()
    kc = torch.randn(shared + seqs * own, block, kv_heads, head_dim, generator=gen).bfloat16()
    vc = torch.randn(shared + seqs * own, block, kv_heads, head_dim, generator=gen).bfloat16()
    q = torch.randn(seqs * new, heads, head_dim, generator=gen)
    lens = torch.full((seqs,), context, dtype=torch.int32)
    starts = torch.arange(0, (seqs + 1) * new, new, dtype=torch.int32)
    md = AttentionMetadata(kv_rows=torch.zeros(seqs * new, dtype=torch.long), block_tables=tables, seq_lens=lens,
                           query_start_loc=starts, seq_lens_list=[context] * seqs, query_lens_list=[new] * seqs,
                           max_query_len=new, max_seq_len=context)
    fallback = CpuAttentionBackend(None)
    want = fallback.forward(q, kc, vc, md, scale)
    iters = 3 if seqs * new * context > 1 << 24 else 7
    row_bytes = kv_heads * head_dim * kc.element_size() * 2                 # one token's K and V, every head
    pairs = seqs * sum(prefix + j + 1 for j in range(new))                  # (query, key) pairs attended
    row = {"seqs": seqs, "prefix": prefix, "new": new, "flops": 4 * pairs * heads * head_dim,
           "bound_mb": (prefix + seqs * new) * row_bytes / 1e6, "torch_mb": seqs * context * row_bytes / 1e6,
           "torch_ms": cpu_time_us(lambda: fallback.forward(q, kc, vc, md, scale), iters) / 1e3}
    out = torch.empty_like(q)
    vmax = vc.float().abs().max().item()
    for v in variants:
        k = load(v)
        for cascade in (True, False):
            name = f"{v}{'' if cascade else '_plain'}"
            stats = k.prefill.prefill_stats(q, kc, vc, tables, lens, starts, list(range(seqs)), scale, out,
                                            cascade=cascade)
            assert stats is not None
            tol = 0.005 * vmax if k.prefill.path(torch.bfloat16) in BF16_PATHS + I16_PATHS else 1e-4
            torch.testing.assert_close(out, want, atol=tol, rtol=0)
            row[f"{name}_ms"] = cpu_time_us(lambda k=k, c=cascade: k.prefill.prefill(
                q, kc, vc, tables, lens, starts, list(range(seqs)), scale, out, cascade=c), iters) / 1e3
            row[f"{name}_mb"] = stats.keys * row_bytes / 1e6
    return row


def bench_cpu(quick: bool) -> None:
    from kernels.cpu.library import cpu_flags, runnable_variants
    from kernels.ops import KernelConfig, Ops

    variants = runnable_variants()
    if not variants:
        sys.exit("no build of the C++ CPU kernels runs here: `make kernels` (or pip install) builds them")
    batches, contexts = ([1, 32], [1024]) if quick else ([1, 16, 64], [256, 1024, 4096])
    gen = torch.Generator().manual_seed(0)
    rows = [cpu_decode_row(batch, context, variants, gen) for batch in batches for context in contexts]
    rows.append(cpu_decode_row(16, 3072 + 64, variants, gen, shared=3072))    # the long3k load's decode steps
    prefill = [cpu_prefill_row(*shape, variants, gen) for shape in (CPU_PREFILL_QUICK if quick else CPU_PREFILL)]
    logits = torch.randn(64, 49152, generator=gen) * 4
    gate_up = torch.randn(64, 2 * 1536, generator=gen).bfloat16()
    x, r, w = torch.randn(64, 576, generator=gen), torch.randn(64, 576, generator=gen).bfloat16(), torch.rand(576)
    ops_rows = []
    impls = [("torch", Ops(KernelConfig(cpu_kernels="none")))] + [(v, Ops(KernelConfig(cpu_kernels=v)))
                                                                    for v in variants]
    for name, ops in impls:
        def stats(ops: Ops = ops, torch_argmax: bool = name == "torch") -> object:
            return (ops.row_stats(logits), logits.argmax(-1)) if torch_argmax else ops.row_stats(logits)
        ops_rows.append({
            "impl": name,
            "row_stats_us": cpu_time_us(stats, 20),
            "topk_us": cpu_time_us(lambda ops=ops: ops.topk(logits, 64), 20),
            "silu_mul_us": cpu_time_us(lambda ops=ops: ops.silu_mul(gate_up, mixed=True), 50),
            "add_rms_norm_us": cpu_time_us(lambda ops=ops: ops.add_rms_norm(x.clone(), r, w, 1e-5, mixed=True), 50),
        })
    flags = cpu_flags()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), "unknown CPU")
    lines = [f"# C++ CPU kernels on {cpu}", "",
             f"torch {torch.__version__}, {torch.get_num_threads()} threads; builds run here: {', '.join(variants)} "
             f"(AVX-512: {'yes' if 'avx512f' in flags else 'no'}). Median wall time of repeated calls, µs.", "",
             "## Paged decode (SmolLM2: 9 q heads, 3 KV heads, head_dim 64, bf16 cache, block 16)", "",
             "| batch | context | torch (gather + SDPA) | " + " | ".join(variants) + " |",
             "|---:|---:|---:|" + "---:|" * len(variants)]
    for row in rows:
        context = f"{row['context']} ({row['shared']} shared)" if row.get("shared") else str(row["context"])
        lines.append(f"| {row['batch']} | {context} | {row['torch_us']:.0f} | "
                     + " | ".join(f"{row[f'{v}_us']:.0f}" for v in variants) + " |")
    lines += ["", "## Paged prefill (the same shapes; one layer's call: every chunk of the step over its context)", "",
              "Chunks of `new` tokens of `seqs` sequences over the same cached `prefix` blocks. ms: median wall "
              "time of one layer's call; GFLOP/s: 4 x (query, key) pairs x heads x head_dim over that time; MB: "
              "K / V bytes read (the bound: the prefix and each chunk once). `plain`: the C++ kernel without "
              "cascade (each sequence walks the prefix itself).", "",
              "| seqs x new over prefix | torch (gather + flash) ms | " + " | ".join(
                  f"{v} ms | {v} plain ms" for v in variants) + " | best GFLOP/s | MB read: torch / "
              "plain / cascade / bound |",
              "|---|---:|" + "---:|---:|" * len(variants) + "---:|---|"]
    for r in prefill:
        best = min(r[f"{v}_ms"] for v in variants)
        last = variants[-1]
        lines.append(f"| {r['seqs']} x {r['new']} over {r['prefix']} | {r['torch_ms']:.1f} | "
                     + " | ".join(f"{r[f'{v}_ms']:.1f} | {r[f'{v}_plain_ms']:.1f}" for v in variants)
                     + f" | {r['flops'] / best / 1e6:.0f} | {r['torch_mb']:.1f} / {r[f'{last}_plain_mb']:.1f} / "
                       f"{r[f'{last}_mb']:.1f} / {r['bound_mb']:.1f} |")
    lines += ["", "## Logits reductions over [64, 49152] and fused elementwise ops over 64 rows", "",
              "| implementation | logsumexp + argmax | top-64 | silu_mul [64, 3072] | add_rms_norm [64, 576] |",
              "|---|---:|---:|---:|---:|"]
    for row in ops_rows:
        lines.append(f"| {row['impl']} | {row['row_stats_us']:.0f} | {row['topk_us']:.0f} | "
                     f"{row['silu_mul_us']:.0f} | {row['add_rms_norm_us']:.0f} |")
    table = "\n".join(lines) + "\n"
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "kernels_cpu.md").write_text(table)
    (RESULTS / "kernels_cpu.json").write_text(json.dumps(dict(cpu=cpu, variants=variants, decode=rows,
                                                              prefill=prefill, ops=ops_rows,
                                                              threads=torch.get_num_threads()),
                                                         indent=2))
    print(f"wrote {RESULTS / 'kernels_cpu'}.md and .json")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    parser.add_argument("--device", default="cuda", help="cuda (the Triton kernels) or cpu (the C++ CPU kernels)")
    parser.add_argument("--threads", type=int, default=None, help="cpu: torch's (and the kernels') threads")
    args = parser.parse_args()
    if args.device == "cpu":
        if args.threads:
            torch.set_num_threads(args.threads)
        bench_cpu(args.quick)
        return
    if not torch.cuda.is_available():
        sys.exit("benchmarks/offline/kernels.py needs a CUDA GPU (torch.cuda.is_available() is False) for the Triton "
                 "kernels; `--device cpu` times the C++ CPU kernels; the kernels' correctness tests run on CPU with "
                 "`make test`.")
    if triton.knobs.runtime.interpret:
        sys.exit("unset TRITON_INTERPRET: the benchmark times compiled kernels, not the interpreter")

    batches, contexts = ([1, 32], [1024, 16384]) if args.quick else ([1, 8, 32, 64], [256, 1024, 4096, 16384, 32768])
    prefill_shapes = [(b, p, n) for b in (1, 8) for p in (1024, 4096) for n in (64, 256)]
    if args.quick:
        prefill_shapes = [(1, 4096, 256), (8, 1024, 64)]

    device = torch.cuda.get_device_name()
    gen = torch.Generator().manual_seed(0)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    copy_gbps = copy_bandwidth_gbps(flush)
    decode, prefill = [], []
    with tqdm(total=len(batches) * len(contexts) + len(prefill_shapes), desc="kernels") as bar:
        for batch in batches:
            for context in contexts:
                bar.set_postfix_str(f"decode b={batch} ctx={context}")
                decode.append(bench_decode(batch, context, flush, copy_gbps, gen))
                torch.cuda.empty_cache()
                bar.update()
        for batch, prefix, new in prefill_shapes:
            bar.set_postfix_str(f"prefill b={batch} prefix={prefix} new={new}")
            prefill.append(bench_prefill(batch, prefix, new, flush, gen))
            torch.cuda.empty_cache()
            bar.update()

    table = markdown(device, copy_gbps, decode, prefill)
    print(table)
    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = "kernels_" + re.sub(r"[^a-z0-9]+", "_", device.lower()).strip("_")
    (RESULTS / f"{stem}.md").write_text(table)
    (RESULTS / f"{stem}.json").write_text(json.dumps(dict(
        device=device, torch=torch.__version__, triton=triton.__version__, copy_gbps=copy_gbps,
        shape=dict(num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, block_size=BLOCK_SIZE,
                   dtype=str(DTYPE)),
        decode=decode, prefill=prefill), indent=2))
    print(f"wrote {RESULTS / stem}.md and .json")


if __name__ == "__main__":
    main()
