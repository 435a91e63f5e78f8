"""Structured output's cost to its neighbours: the throughput of unconstrained requests with and without
one constrained (JSON-schema) request in the same batches.

    prefixserve bench structured [--quick] [--model M] [--out DIR]

Each round runs the same N unconstrained prompts (seeded sampling, fixed output length, EOS ignored)
twice in one engine, beside one more request that is either unconstrained or constrained to a JSON
schema (the same prompt and length budget), alternating which goes first; the figure is the N
unconstrained requests' tokens per second (their tokens / the time until the last of them ends). The
RESULT is the median over rounds of constrained / unconstrained neighbour (1.0 = constraining one row
costs the others nothing), plus the mask time per constrained token measured in place. ("alone" in the
result's keys: the N beside an unconstrained ninth.)
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

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
from engine.sample.structured import StructuredSpec

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "maxItems": 3},
    "note": {"type": "string", "maxLength": 40}},
    "required": ["name", "age", "tags", "note"], "additionalProperties": False}


def run(llm: LLM, prompts: list[list[int]], out_len: int, constrained: bool, seed: int) -> float:
    free = [SamplingParams(temperature=1.0, seed=seed + i, max_tokens=out_len, ignore_eos=True)
            for i in range(len(prompts))]
    # The ninth request is the same in both runs but for its constraint, so the batch does the same work
    # and the difference is what constraining one row costs the others.
    batch, params = list(prompts) + [prompts[0]], list(free)
    spec = StructuredSpec("json_schema", json.dumps(SCHEMA)) if constrained else None
    params.append(SamplingParams(temperature=1.0, seed=seed, max_tokens=out_len, ignore_eos=not constrained,
                                 structured=spec))
    t = time.perf_counter()
    outs = llm.generate(batch, params)
    dt = time.perf_counter() - t
    return sum(len(o.outputs[0].token_ids) for o in outs[:len(prompts)]) / dt


def main(argv: list[str] | None = None, prog: str = "prefixserve bench structured") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    if args.quick:
        args.num_prompts, args.output_len, args.rounds = 8, 32, 4
    setup_torch(args)
    llm = LLM(args.model, device=args.device, dtype=args.dtype, kv_backend=args.kv_backend,
              quantization=args.quantization,
              max_model_len=1024, num_kv_blocks=1024)
    prompts = random_prompts([48] * args.num_prompts, llm.engine.core.vocab_size, args.seed)
    llm.engine.core.grammars.compile(StructuredSpec("json_schema", json.dumps(SCHEMA)))   # compile outside the timing
    run(llm, prompts[:2], 4, True, args.seed)                                           # warm-up
    alone, shared = [], []
    for r in tqdm(range(args.rounds), desc="structured"):
        order = (False, True) if r % 2 == 0 else (True, False)
        for constrained in order:
            (shared if constrained else alone).append(run(llm, prompts, args.output_len, constrained, args.seed + r))
    ratios = [s / a for s, a in zip(shared, alone)]
    grammars = llm.engine.core.grammars
    matcher = grammars.matcher(StructuredSpec("json_schema", json.dumps(SCHEMA)))
    mask = grammars.bitmask(1)
    t = time.perf_counter()
    for _ in range(200):
        matcher.fill_next_token_bitmask(mask, 0)
    mask_us = (time.perf_counter() - t) / 200 * 1e6
    result = {"unconstrained_tok_s_alone": statistics.median(alone), "unconstrained_tok_s_beside_constrained":
              statistics.median(shared), "ratio_median": statistics.median(ratios), "ratios": ratios,
              "mask_us_per_token": mask_us, "num_prompts": args.num_prompts, "output_len": args.output_len}
    table = ("| unconstrained requests | tok/s (median) |\n|---|---:|\n"
             f"| beside one unconstrained request | {result['unconstrained_tok_s_alone']:.1f} |\n"
             f"| beside one JSON-schema request | {result['unconstrained_tok_s_beside_constrained']:.1f} |\n\n"
             f"constrained / unconstrained neighbour, median of {args.rounds} paired rounds: "
             f"**{result['ratio_median']:.3f}** "
             f"(pairs: {', '.join(f'{x:.3f}' for x in ratios)}); mask fill {mask_us:.1f} us per constrained token.")
    fig, (ax,) = new_figure()
    ax.bar(["alone", "beside constrained"], [result["unconstrained_tok_s_alone"],
                                            result["unconstrained_tok_s_beside_constrained"]])
    ax.set_ylabel("unconstrained tok/s")
    write_results("structured", table, {"result": result}, args.out, fig, command_line(prog, argv))
    print_result(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
