"""The engine beside a busy neighbour: fixed compute threads against the thread governor (--adaptive-threads,
engine/worker/threads.py).

    prefixserve bench threads [--quick] [--rounds N] [--model M] [--out DIR]

Each round runs two engines in turn (the order swapped every other round), both on every core this process
may use: one with the governor, one without. Each runs three phases: alone, beside a spinning Python process
pinned to the last of those cores, alone again; each phase a 1,024-token prefill and 8 requests of 128 tokens
that generate 32 (distinct prompts: nothing hits the prefix cache). Reported: each figure's median over the
rounds, each engine's slowdown beside the neighbour (its own busy / alone), and the governor's gain (fixed /
adaptive, paired per round). Needs two cores or more.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from tqdm import tqdm

from benchmarks.common import add_common_args, command_line, median_ratio, new_figure, print_result, write_results
from benchmarks.served.peers.contention import busy_neighbour
from engine import LLM, SamplingParams

MODES = ("fixed", "adaptive")
PHASES = ("alone", "busy", "alone again")
LOADS = ("prefill 1,024", "8 x 128 in / 32 out")


def run_phase(llm: LLM, salt: int, prefill_len: int = 1024) -> dict[str, float]:
    """One phase's two workloads, in seconds; `salt` makes every prompt new to the prefix cache."""
    vocab = llm.engine.loaded.args.vocab_size
    ids = [(i * 7919 + salt * 104729) % (vocab - 100) + 100 for i in range(prefill_len)]
    t = time.perf_counter()
    llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1))
    prefill = time.perf_counter() - t
    prompts = [[(salt * 31 + i * 17 + j * 7919) % (vocab - 100) + 100 for j in range(128)] for i in range(8)]
    t = time.perf_counter()
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True))
    return {LOADS[0]: prefill, LOADS[1]: time.perf_counter() - t}


def run_mode(args: argparse.Namespace, adaptive: bool, threads: int, core: int, salt: int) -> dict[str, dict]:
    llm = LLM(args.model, torch_threads=threads, adaptive_threads=adaptive, quantization=args.quantization)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4))                    # warm-up
    out: dict[str, dict] = {}
    out["alone"] = run_phase(llm, salt, args.prefill_len)
    with busy_neighbour(core):
        time.sleep(0.2)
        out["busy"] = run_phase(llm, salt + 1, args.prefill_len)
    out["alone again"] = run_phase(llm, salt + 2, args.prefill_len)
    gov = llm.engine.core.threads
    out["changes"] = {"count": gov.changes if gov is not None else 0}
    del llm
    torch.set_num_threads(threads)
    return out


def main(argv: list[str] | None = None, prog: str = "prefixserve bench threads") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--rounds", type=int, default=None, help="default 3, --quick 1")
    ap.add_argument("--prefill-len", type=int, default=1024, help="the prefill's prompt tokens (the table still "
                    "says 1,024: a smaller model's context may need fewer)")
    args = ap.parse_args(argv)
    import os
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        print(f"{prog}: needs two cores or more (this process may use {len(cores)})", file=sys.stderr)
        return 1
    rounds = args.rounds or (1 if args.quick else 3)
    runs: dict[str, list[dict]] = {m: [] for m in MODES}
    with tqdm(total=rounds * len(MODES), desc="threads") as bar:
        for r in range(rounds):
            for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                salt = 1000 * r + 10 * len(mode)
                runs[mode].append(run_mode(args, mode == "adaptive", len(cores), cores[-1], salt))
                bar.update()

    def med(mode: str, phase: str, load: str) -> float:
        return statistics.median(run[phase][load] for run in runs[mode])

    def figures(mode: str, phase: str, load: str) -> list[float]:
        return [run[phase][load] for run in runs[mode]]

    rows = []
    for load in LOADS:
        for phase in PHASES:
            gain = median_ratio(figures("fixed", phase, load), figures("adaptive", phase, load))
            rows.append(f"| {load}, {phase} | {med('fixed', phase, load):.2f} s | {med('adaptive', phase, load):.2f} s "
                        f"| **{gain:.2f}x** |")
    slow = {m: {load: median_ratio(figures(m, "busy", load), figures(m, "alone", load)) for load in LOADS}
            for m in MODES}
    for load in LOADS:
        rows.append(f"| {load}: slowdown beside the neighbour (busy / alone) | {slow['fixed'][load]:.2f}x | "
                    f"{slow['adaptive'][load]:.2f}x | |")
    table = (f"| workload | fixed {len(cores)} threads | adaptive | fixed / adaptive |\n|---|---:|---:|---:|\n"
             + "\n".join(rows) + f"\n\nMedians over {rounds} round(s); the neighbour spins on core {cores[-1]}. "
             f"Thread changes by the governor per round: {[x['changes']['count'] for x in runs['adaptive']]}. "
             f"1-minute load average at the end: {os.getloadavg()[0]:.2f}.")
    print(table)
    fig, axes = new_figure(len(LOADS), width=5.0)
    for ax, load in zip(axes, LOADS):
        xs = range(len(PHASES))
        ax.bar([x - 0.2 for x in xs], [med("fixed", p, load) for p in PHASES], 0.4, label="fixed", color="tab:gray")
        ax.bar([x + 0.2 for x in xs], [med("adaptive", p, load) for p in PHASES], 0.4, label="adaptive",
               color="tab:blue")
        ax.set_xticks(list(xs), PHASES)
        ax.set_ylabel("seconds (lower is better)")
        ax.set_title(load)
        ax.legend()
    result = {f"slowdown_{m}_{i}": round(slow[m][load], 3) for m in MODES for i, load in enumerate(LOADS)}
    write_results("threads", table, {"result": result, "runs": runs, "rounds": rounds, "cores": cores},
                  out_dir=args.out, figure=fig, command=command_line(prog, argv))
    print_result(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
