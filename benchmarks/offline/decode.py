"""Decode speed on the CPU against llama.cpp, and against the memory-bandwidth bound.

    prefixserve bench decode [--quick] [--model M.gguf] [--out DIR]

Same model for every row (default: the built-in SmolLM2-135M-Instruct Q4_1 GGUF), same chat prompts,
`--output-len` tokens each, EOS ignored, `--threads` torch threads (default 2 here: all the cores):

- batch 1: one request at a time; decode tok/s = (tokens - 1) / (last token - first token), the median
  over `--rounds` requests;
- 16 streams: 16 requests at once; tok/s = all output tokens / wall time (prefill included);
- rows: prefixserve with weights dequantized to fp32 (`--quantization none`), int8 and int4 (the
  GGUF's own Q4_1 blocks), int4 again with `--compile-decode` (its compile time at startup shown), and
  llama.cpp (llama-cpp-python on the same GGUF, n_threads the same) when it can be imported here;
  otherwise llama.cpp is reported absent and no ratio against it is computed (never a recorded figure).
- bound: the tokens per second that memory bandwidth allows if every step reads the weights once
  (batch 1: bytes of the weights read per token + that step's KV; 16 streams: the same bytes buy 16
  tokens), with bandwidth measured here by a large tensor copy; `of bound` = measured / bound.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.common import add_common_args, command_line, new_figure, print_result, setup_torch, write_results
from engine import LLM, SamplingParams
from engine.models.default import default_model_path

QUESTIONS = ["What is the capital of France?", "Name three primary colors.", "How many legs does a spider have?",
             "What is 12 times 12?", "Who wrote Romeo and Juliet?", "What is the boiling point of water?",
             "Give me a synonym for happy.", "What planet is known as the red planet?",
             "Translate 'thank you' into Spanish.", "What is the largest ocean on Earth?",
             "How many days are in a leap year?", "What gas do plants absorb?", "What is the square root of 81?",
             "Name a mammal that can fly.", "What is the freezing point of water in Fahrenheit?",
             "Which language has the most native speakers?"]


def bandwidth_gb_s() -> float:
    """Copy bandwidth (read + write) of a 512 MiB float32 tensor, the best of 5."""
    src = torch.ones(128 * 2**20)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * src.numel() * 4 / best / 1e9


def weight_bytes(llm: LLM) -> int:
    """Bytes a decode step reads of the weights: every parameter and buffer but the embedding table
    (one row per token) and the RoPE frequencies."""
    model = llm.engine.core.loaded.model
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    total += sum(b.numel() * b.element_size() for n, b in model.named_buffers() if "inv_freq" not in n)
    emb = model.embed_tokens.weight
    tied_and_dense = model.args.tie_word_embeddings and getattr(model.lm_head, "weight", None) is emb
    return total - (0 if tied_and_dense else emb.numel() * emb.element_size())


def prompts_of(tokenizer: Any, n: int) -> list[list[int]]:
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}],
                                               add_generation_prompt=True, tokenize=True, return_dict=False))
            for i in range(n)]


def ours(llm: LLM, prompts: list[list[int]], out_len: int, rounds: int) -> dict[str, float]:
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=out_len, ignore_eos=True)
    rates = []
    for r in range(rounds):                                          # batch 1, decode only
        engine.add_request(f"one-{time.perf_counter_ns()}", prompts[r % len(prompts)], params)
        first = last = None
        while engine.has_unfinished():
            engine.step()
            now = time.perf_counter()
            first = first or now
            last = now
        assert first is not None and last is not None
        rates.append((out_len - 1) / (last - first))
    t = time.perf_counter()                                          # 16 streams, wall time
    outs = llm.generate(prompts[:16], params)
    wall = time.perf_counter() - t
    return {"batch1_tok_s": statistics.median(rates), "streams16_tok_s": sum(len(o.outputs[0].token_ids)
                                                                             for o in outs) / wall}


def llama_cpp(path: str, prompts: list[list[int]], out_len: int, rounds: int, threads: int) -> dict[str, float] | None:
    try:
        from llama_cpp import Llama
    except ImportError:
        return None
    llm = Llama(model_path=path, n_ctx=2048, n_threads=threads, n_batch=512, verbose=False)

    def one(tokens: list[int]) -> tuple[float, float, int]:
        start, first, n = time.perf_counter(), 0.0, 0
        for _ in llm.generate(tokens, temp=0.0, top_k=1, reset=True):
            n += 1
            if n == 1:
                first = time.perf_counter()
            if n == out_len:
                break
        return start, first, n

    rates = []
    for r in range(rounds):
        _, first, n = one(prompts[r % len(prompts)])
        rates.append((n - 1) / (time.perf_counter() - first))
    t = time.perf_counter()
    total = sum(one(p)[2] for p in prompts[:16])                     # its server runs one request at a time
    return {"batch1_tok_s": statistics.median(rates), "streams16_tok_s": total / (time.perf_counter() - t)}


def main(argv: list[str] | None = None, prog: str = "prefixserve bench decode") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--quantizations", nargs="+", default=["none", "int8", "int4"])
    ap.add_argument("--compiled", nargs="*", default=["int4"], help="quantizations also run with --compile-decode")
    ap.set_defaults(threads=2)
    args = ap.parse_args(argv)
    if args.quick:
        args.output_len, args.rounds = 32, 3
    setup_torch(args)
    bw = bandwidth_gb_s()
    rows: list[dict[str, Any]] = []
    model_path = None
    configs = [(q, False) for q in args.quantizations] + [(q, True) for q in args.compiled]
    for q, compiled in tqdm(configs, desc="decode"):
        t = time.perf_counter()
        llm = LLM(args.model, quantization=q, max_model_len=1024, num_kv_blocks=2048, max_num_seqs=16,
                  compile_decode=compiled)
        start_s = time.perf_counter() - t
        model_path = str(llm.engine.core.loaded.path)
        prompts = prompts_of(llm.tokenizer, 16)
        ours(llm, prompts, 4, 1)                                     # warm-up
        got = ours(llm, prompts, args.output_len, args.rounds)
        wb = weight_bytes(llm)
        margs = llm.engine.core.loaded.args
        kv_token = 2 * margs.num_layers * margs.num_kv_heads * margs.head_dim * 4          # fp32 K and V, bytes
        ctx = statistics.mean(len(p) for p in prompts) + args.output_len / 2
        bound1 = bw * 1e9 / (wb + kv_token * ctx)
        bound16 = 16 * bw * 1e9 / (wb + 16 * kv_token * ctx)
        rows.append({"name": f"prefixserve, {q}{', compiled' if compiled else ''}", "weights_mb": wb / 1e6, **got,
                     "bound1": bound1, "bound16": bound16, "start_s": start_s})
        del llm
    gguf = args.model or str(default_model_path())
    peer = llama_cpp(gguf, prompts, args.output_len, args.rounds, args.threads) if gguf.endswith(".gguf") else None
    best = max(rows, key=lambda r: r["batch1_tok_s"])
    result = {"bandwidth_gb_s": bw, "rows": rows, "llama_cpp": peer,
              "batch1_vs_llama_cpp": best["batch1_tok_s"] / peer["batch1_tok_s"] if peer else None,
              "streams16_vs_llama_cpp": max(r["streams16_tok_s"] for r in rows) / peer["streams16_tok_s"]
              if peer else None,
              "best": best["name"], "best_of_bound_batch1": best["batch1_tok_s"] / best["bound1"]}
    lines = ["| engine | weights read per step | batch 1 tok/s | bound | of bound | 16 streams tok/s | bound | "
             "of bound | start |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['name']} | {r['weights_mb']:.0f} MB | {r['batch1_tok_s']:.1f} | {r['bound1']:.0f} | "
                     f"{r['batch1_tok_s'] / r['bound1']:.2f} | {r['streams16_tok_s']:.1f} | {r['bound16']:.0f} | "
                     f"{r['streams16_tok_s'] / r['bound16']:.2f} | {r['start_s']:.1f} s |")
    if peer is not None:
        lines.append(f"| llama.cpp | | {peer['batch1_tok_s']:.1f} | | | {peer['streams16_tok_s']:.1f} (one at a time) "
                     "| | | |")
        versus = (f"Best batch 1 ({best['name']}) / llama.cpp: **{result['batch1_vs_llama_cpp']:.2f}x**; best 16 "
                  f"streams / llama.cpp's one-at-a-time server: **{result['streams16_vs_llama_cpp']:.2f}x**.")
    else:
        lines.append("| llama.cpp | absent: llama_cpp cannot be imported here | | | | | | | |")
        versus = "llama.cpp absent: no ratio against it."
    table = "\n".join(lines) + (
        f"\n\n{versus} Copy bandwidth "
        f"{bw:.1f} GB/s; bound = bandwidth / (weight bytes + KV bytes read per step). {args.output_len} output "
        f"tokens, {args.rounds} batch-1 requests (median), 16 chat prompts, {args.threads} threads; start: the "
        f"engine's construction (load, quantize, compile). Model: "
        f"{Path(model_path or '').name}.")
    fig, (ax,) = new_figure()
    shown = rows + ([{"name": "llama.cpp", **peer}] if peer else [])
    names = [r["name"].removeprefix("prefixserve, ").replace(", compiled", "\ncompiled") for r in shown]
    xs = range(len(names))
    ax.bar([x - 0.2 for x in xs], [r["batch1_tok_s"] for r in shown], 0.4, label="batch 1")
    ax.bar([x + 0.2 for x in xs], [r["streams16_tok_s"] for r in shown], 0.4, label="16 streams")
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("output tok/s")
    ax.legend()
    write_results("decode", table, {"result": result}, args.out, fig, command_line(prog, argv))
    print_result({k: v for k, v in result.items() if k != "rows"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
