"""GPU benchmark of the paged attention kernels against contiguous SDPA on the same data.

    python benchmarks/offline/kernels.py                 # full sweep, ~a few minutes on an H100
    python benchmarks/offline/kernels.py --quick         # batch {1, 32} x context {1K, 16K}, fewer prefill shapes

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a few shapes only")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("benchmarks/offline/kernels.py needs a CUDA GPU (torch.cuda.is_available() is False); "
                 "the kernels' correctness tests run on CPU with `make test` instead.")
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
