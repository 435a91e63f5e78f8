"""KV blocks saved by sharing them between the sequences of one request: parallel sampling (n) and
beam search (width), on short and long prompts, against the vLLM paper (figure 15, Alpaca trace:
6.1-9.8% saved with parallel sampling, 37.6-55.2% with beam search), and throughput with sharing on/off.

    python -m benchmarks.offline.sharing [--quick] [--model DIR] [--num-prompts N]

Workloads: ShareGPT-like lengths (benchmarks.common.sharegpt_like_lengths, seeded) times --scale;
"long" prompts are the same prompts 4x longer with the same outputs. Random prompt tokens, EOS ignored
(every sequence runs to max_tokens). Parallel sampling: SamplingParams(n=k, temperature=1, seed);
beam search: SamplingParams(use_beam_search=True, best_of=width, n=1).

Sharing ON is the engine as it is: forks take a reference on every block of the parent, and the
shared partial last block is copied on the first write (copy-on-write).
Sharing FORCED OFF: in the same engine, `BlockManager.fork` is replaced (on this engine instance
only) by a fork that allocates fresh blocks for the child and queues a block copy of every parent
block: each sample / beam then owns a private copy of the prompt and of its history, as in a system
without block sharing. Scheduling is otherwise identical (the prompt is still computed once), so the
two runs take the same steps. Prefix caching is off in both runs so that only fork sharing counts.

Measured, for each run, `engine.stats().kv_blocks_used` after every `engine.step()`:
  saved = 1 - sum_steps(used, on) / sum_steps(used, off)  (time-averaged KV memory; also at the peak)
cross-checked inside the ON run against the sum of the running sequences' block-table lengths
(what the same sequences would hold without sharing). Throughput: sequence tokens generated per second
(n x max_tokens per request for sampling, width x max_tokens for beam search), on / off back to back,
in alternating order.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
import types
from dataclasses import dataclass, field
from typing import Any

from tqdm import tqdm

from benchmarks.common import (
    add_common_args,
    command_line,
    new_figure,
    print_result,
    random_prompts,
    run_engine,
    setup_torch,
    sharegpt_like_lengths,
    write_results,
)
from engine.kv.block_manager import BlockManager, SeqBlocks

PAPER = {"parallel": (0.061, 0.098), "beam": (0.376, 0.552)}


def fork_by_copy(self: BlockManager, parent_id: int, child_id: int) -> None:
    """BlockManager.fork without sharing: the child gets new blocks and a copy of every parent block."""
    parent = self._seqs[parent_id]
    fresh = self.pool.allocate(len(parent.blocks))
    self.pending_copies.extend((p.block_id, c.block_id) for p, c in zip(parent.blocks, fresh))
    self._seqs[child_id] = SeqBlocks(fresh, list(parent.hashes), parent.num_cached_blocks)


def set_sharing(manager: BlockManager, on: bool) -> None:
    if on:
        manager.__dict__.pop("fork", None)          # back to the class's sharing fork
    else:
        manager.fork = types.MethodType(fork_by_copy, manager)  # type: ignore[method-assign]


@dataclass
class Trace:
    """Per-step KV blocks of one run."""

    used: list[int] = field(default_factory=list)
    unshared: list[int] = field(default_factory=list)   # sum of the running sequences' table lengths
    seconds: float = 0.0

    def record(self, engine: Any) -> None:
        self.used.append(engine.stats().kv_blocks_used - engine.stats().kv_blocks_pinned)
        m = engine.core.manager
        self.unshared.append(sum(m.num_blocks(s.seq_id) for s in engine.core.scheduler.running if m.has(s.seq_id)))


def blocks_saved(on: list[int], off: list[int]) -> float:
    """1 - block-steps with sharing / block-steps without (time-averaged KV memory saved)."""
    return 1.0 - sum(on) / sum(off) if sum(off) else 0.0


def run_once(engine: Any, prompts: list[list[int]], params: list[Any], sharing: bool) -> Trace:
    set_sharing(engine.core.manager, sharing)
    trace = Trace()
    t = time.perf_counter()
    run_engine(engine, prompts, params, on_step=trace.record, prefix="share" if sharing else "copy")
    trace.seconds = time.perf_counter() - t
    set_sharing(engine.core.manager, True)
    assert engine.stats().kv_blocks_used == engine.stats().kv_blocks_pinned, "blocks leaked"
    return trace


def make_params(kind: str, k: int, outputs: list[int], seed: int) -> list[Any]:
    from engine import SamplingParams
    if kind == "parallel":
        return [SamplingParams(n=k, temperature=1.0, seed=seed + i, max_tokens=o, ignore_eos=True)
                for i, o in enumerate(outputs)]
    return [SamplingParams(n=1, best_of=k, use_beam_search=True, temperature=0.0, max_tokens=o, ignore_eos=True)
            for o in outputs]


def plot(rows: list[dict[str, Any]]):
    fig, (ax1, ax2) = new_figure(2, width=6.0)
    for kind, color in (("parallel", "tab:blue"), ("beam", "tab:orange")):
        for length, style in (("short", "-o"), ("long", "--s")):
            sel = [r for r in rows if r["kind"] == kind and r["prompts"] == length]
            ks = [r["k"] for r in sel]
            label = f"{'parallel sampling (n)' if kind == 'parallel' else 'beam search (width)'}, {length}"
            ax1.plot(ks, [100 * r["saved"] for r in sel], style, color=color, label=label)
            ax2.plot(ks, [r["throughput_ratio"] for r in sel], style, color=color, label=label)
        lo, hi = PAPER[kind]
        ax1.axhspan(100 * lo, 100 * hi, color=color, alpha=0.12)
    ax1.set_xlabel("n / beam width")
    ax1.set_ylabel("KV blocks saved by sharing (%)")
    ax1.set_title("Memory saved (shaded: vLLM paper, Alpaca)")
    ax1.legend(fontsize=7)
    ax2.axhline(1.0, color="k", lw=0.8)
    ax2.set_xlabel("n / beam width")
    ax2.set_ylabel("throughput, sharing on / off")
    ax2.set_title("Throughput ratio (sequence tokens/s)")
    return fig


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.offline.sharing") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--num-prompts", type=int, default=None, help="requests per run (default 8, --quick 3)")
    ap.add_argument("--scale", type=float, default=None,
                    help="multiplies the ShareGPT-like lengths (default 0.25, --quick 0.125: Alpaca-sized)")
    ap.add_argument("--max-output", type=int, default=None, help="clip output lengths (default 256, --quick 48)")
    ap.add_argument("--ks", default="2,4,6", help="n and beam widths")
    args = ap.parse_args(argv)
    setup_torch(args)
    from engine import LLM, SamplingParams
    num = args.num_prompts or (3 if args.quick else 8)
    scale = args.scale or (0.125 if args.quick else 0.25)
    max_out = args.max_output or (48 if args.quick else 256)
    ks = [int(k) for k in args.ks.split(",")]
    llm = LLM(args.model, device=args.device, dtype=args.dtype, kv_backend=args.kv_backend,
              quantization=args.quantization, enable_prefix_caching=False,
              max_num_seqs=256, max_num_batched_tokens=4096)
    engine = llm.engine
    vocab = engine.loaded.args.vocab_size
    lengths = sharegpt_like_lengths(num, args.seed, scale=scale)
    outputs = [min(o, max_out) for _, o in lengths]
    short = random_prompts([p for p, _ in lengths], vocab, args.seed + 1)
    long = random_prompts([4 * p for p, _ in lengths], vocab, args.seed + 2)
    run_engine(engine, [[5, 6, 7]], SamplingParams(max_tokens=4))             # warm-up

    rows: list[dict[str, Any]] = []
    configs = [(kind, length, k) for kind in ("parallel", "beam") for length in ("short", "long") for k in ks]
    for i, (kind, length, k) in enumerate(tqdm(configs, desc="sharing")):
        prompts = short if length == "short" else long
        params = make_params(kind, k, outputs, args.seed)
        order = (True, False) if i % 2 == 0 else (False, True)
        runs = {sharing: run_once(engine, prompts, params, sharing) for sharing in order}
        on, off = runs[True], runs[False]
        seq_tokens = k * sum(outputs)
        rows.append({
            "kind": kind, "prompts": length, "k": k,
            "mean_prompt": sum(map(len, prompts)) / num, "mean_output": sum(outputs) / num,
            "saved": blocks_saved(on.used, off.used),
            "saved_peak": 1.0 - max(on.used) / max(off.used),
            "saved_in_run": blocks_saved(on.used, on.unshared),
            "steps_on": len(on.used), "steps_off": len(off.used),
            "tok_s_on": seq_tokens / on.seconds, "tok_s_off": seq_tokens / off.seconds,
            "throughput_ratio": off.seconds / on.seconds,
        })
    assert engine.stats().preemptions_total == 0, "memory pressure would confound the comparison"

    lines = ["| workload | n / width | mean prompt / output | blocks saved (avg) | at peak | in-run check | "
             "paper (Alpaca) | tok/s on | tok/s off | on / off |", "|---|---:|---|---:|---:|---:|---|---:|---:|---:|"]
    for r in rows:
        lo, hi = PAPER[r["kind"]]
        name = ("parallel sampling" if r["kind"] == "parallel" else "beam search") + f", {r['prompts']} prompts"
        lines.append(f"| {name} | {r['k']} | {r['mean_prompt']:.0f} / {r['mean_output']:.0f} | "
                     f"{100 * r['saved']:.1f}% | {100 * r['saved_peak']:.1f}% | {100 * r['saved_in_run']:.1f}% | "
                     f"{100 * lo:.1f}-{100 * hi:.1f}% | {r['tok_s_on']:.1f} | {r['tok_s_off']:.1f} | "
                     f"{r['throughput_ratio']:.2f}x |")
    table = "\n".join(lines) + (
        f"\n\n{num} requests per run, block size {engine.core.block_size}, {args.dtype}. Blocks saved = "
        "1 - block-steps with sharing / block-steps with sharing forced off (forks copy every block), "
        "kv_blocks_used sampled after every engine step; 'at peak' compares the largest per-step values; "
        "'in-run check' compares, within the sharing run, distinct blocks in use with the sum of the running "
        "sequences' block tables. Throughput: sequence tokens per second, each pair run back to back.")
    print(table)

    def pick(kind: str, key: str) -> list[float]:
        return [r[key] for r in rows if r["kind"] == kind]

    result = {
        "parallel_saved_min": round(min(pick("parallel", "saved")), 4),
        "parallel_saved_max": round(max(pick("parallel", "saved")), 4),
        "beam_saved_min": round(min(pick("beam", "saved")), 4),
        "beam_saved_max": round(max(pick("beam", "saved")), 4),
        "parallel_throughput_ratio": round(statistics.median(pick("parallel", "throughput_ratio")), 3),
        "beam_throughput_ratio": round(statistics.median(pick("beam", "throughput_ratio")), 3),
    }
    write_results("sharing", table, {"result": result, "rows": rows, "paper_fig15_alpaca": PAPER,
                                     "num_prompts": num, "scale": scale, "max_output": max_out},
                  out_dir=args.out, figure=plot(rows), command=command_line(prog, argv))
    print_result(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
