"""Offline throughput: the engine vs transformers `generate` with static batching.

The transformers side follows vLLM's benchmark_throughput `hf` backend: prompts are grouped into
padded batches (up to --hf-batch requests, while max prompt + max output <= 2048), each batch runs
`generate` with max_new_tokens = the batch's longest output, EOS ignored. Both sides get the same
prompts and count the same tokens: the requested output tokens.

    python -m benchmarks.offline.throughput [--quick] [--model DIR] [--num-prompts N]

The engine runs first, then transformers (one model in memory at a time), on the same torch threads.
"""
from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import torch
from tqdm import tqdm

from benchmarks.common import (
    add_common_args,
    command_line,
    new_figure,
    print_result,
    setup_torch,
    sharegpt_like_lengths,
    write_results,
)
from engine import LLM, SamplingParams


def make_requests(vocab: int, n: int, scale: float, seed: int) -> list[tuple[list[int], int]]:
    rng = np.random.default_rng(seed + 1)
    return [(rng.integers(3, vocab, size=i).tolist(), o) for i, o in sharegpt_like_lengths(n, seed, scale=scale)]


def run_engine(llm: LLM, reqs: list[tuple[list[int], int]]) -> float:
    params = [SamplingParams(temperature=1.0, max_tokens=o, ignore_eos=True, seed=i) for i, (_, o) in enumerate(reqs)]
    t = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=True)
    dt = time.perf_counter() - t
    assert sum(len(o.outputs[0].token_ids) for o in outs) == sum(o for _, o in reqs)
    return dt


def run_hf(model_dir: str, reqs: list[tuple[list[int], int]], max_batch: int, dtype: str = "float32",
           device: str = "cpu") -> float:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).to(device)
    hf.generation_config.eos_token_id = None
    pad = 0
    batches, cur = [], []
    for r in reqs:
        cand = cur + [r]
        if cur and (len(cand) > max_batch or max(len(p) for p, _ in cand) + max(o for _, o in cand) > 2048):
            batches.append(cur)
            cand = [r]
        cur = cand
    batches.append(cur)
    t = time.perf_counter()
    for batch in tqdm(batches, desc="transformers"):
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch], device=device)  # left padding
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device)
        with torch.inference_mode():
            hf.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0,
                        max_new_tokens=max(o for _, o in batch), pad_token_id=pad, eos_token_id=None)
    return time.perf_counter() - t


def plot(engine_tok_s: float, hf_tok_s: float, ratio: float):
    fig, (ax,) = new_figure(1, width=5.5)
    bars = ax.bar(["prefixserve engine", "transformers generate"], [engine_tok_s, hf_tok_s],
                  color=["tab:blue", "tab:gray"])
    ax.bar_label(bars, fmt="%.1f")
    ax.set_ylabel("output tokens / s")
    ax.set_title(f"Offline throughput: engine / transformers = {ratio:.2f}x")
    return fig


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.offline.throughput") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--num-prompts", type=int, default=None, help="default 200, --quick 32")
    ap.add_argument("--scale", type=float, default=None, help="multiplies the ShareGPT-like lengths "
                    "(default 1, --quick 0.25)")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    args = ap.parse_args(argv)
    setup_torch(args)
    n = args.num_prompts or (32 if args.quick else 200)
    scale = args.scale or (0.25 if args.quick else 1.0)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, kv_backend=args.kv_backend,
              quantization=args.quantization,
              max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048)
    model_dir = str(llm.engine.loaded.path)
    quant = llm.engine.loaded.quantization
    reqs = make_requests(llm.engine.loaded.args.vocab_size, n, scale, args.seed)
    out_tokens = sum(o for _, o in reqs)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))                   # warm-up
    engine_s = run_engine(llm, reqs)
    del llm
    hf_s = run_hf(model_dir, reqs, args.hf_batch, args.dtype, args.device)
    engine_tok_s, hf_tok_s = out_tokens / engine_s, out_tokens / hf_s
    ratio = engine_tok_s / hf_tok_s
    mean_in = sum(len(p) for p, _ in reqs) / n
    table = ("| backend | seconds | output tok/s |\n|---|---|---|\n"
             f"| prefixserve engine | {engine_s:.1f} | {engine_tok_s:.1f} |\n"
             f"| transformers generate (static batches of {args.hf_batch}) | {hf_s:.1f} | {hf_tok_s:.1f} |\n\n"
             f"{n} requests, mean input {mean_in:.0f} / output {out_tokens / n:.0f} tokens, EOS ignored, "
             f"{args.dtype}, our weights {quant} (transformers: the same checkpoint dequantized to "
             f"{args.dtype}). **engine / transformers = {ratio:.2f}x** (target on CPU: >= 2x; the vLLM paper "
             "reports 14-24x on GPUs).")
    print(table)
    result = {"engine_tok_s": round(engine_tok_s, 2), "hf_tok_s": round(hf_tok_s, 2), "ratio": round(ratio, 3)}
    write_results("throughput", table, {"result": result, "num_prompts": n, "scale": scale,
                                        "engine_s": engine_s, "hf_s": hf_s, "output_tokens": out_tokens},
                  out_dir=args.out, figure=plot(engine_tok_s, hf_tok_s, ratio), command=command_line(prog, argv))
    print_result(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
