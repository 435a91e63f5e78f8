"""KV-cache memory: one request trace replayed through our paged block pool and through contiguous
reservation (the vLLM paper's Orca baselines, section 6 / figure 2). Pure Python, no model.

    python -m benchmarks.offline.memory [--quick] [--num-requests N] [--memory-tokens M]

Trace: ShareGPT-like lengths (benchmarks.common.sharegpt_like_lengths: log-normal, mean 161 in /
338 out, seed), prompt + output clipped to max_model_len (2048, OPT's, as in the paper). All requests are
submitted at once and admitted first come first served as memory allows (no arrival process: memory
is the only bound). A request's prompt KV is written in the step that admits it (which samples its
first token); each later step writes the previous token's KV and samples one more, so a request with
output length o runs o steps, holding prompt .. prompt + o - 1 tokens, then frees its memory.

- paged: engine.kv.block_manager.BlockManager over engine.kv.block_pool.BlockPool (the engine's own
  allocator), block size 16; blocks are taken on demand, one more each time a sequence crosses a block
  boundary; when a growing sequence finds no free block the youngest running one is preempted (its
  blocks freed, requeued at the front), as engine/sched/scheduler.py does.
- contiguous: a first-fit allocator over one address range of the same number of token slots; each
  request reserves, at admission, one contiguous chunk and keeps it to the end:
    Orca (Max)    max_model_len slots;
    Orca (Pow2)   prompt + the next power of two >= the true output length (at most max_model_len);
    Orca (Oracle) exactly prompt + true output length.

Every step is sampled: live = token slots holding KV of a running request; reserved = slots handed to
running requests (paged: blocks x block size). `utilization` = mean over steps of live / reserved
(the RESULT figures). The paper's figure 2 divides by the whole KV memory instead, so it also counts
external fragmentation and memory no request could use; that is `of_memory`, averaged over the steps
where requests were still waiting (memory was the bound), and its breakdown: token states,
reservation (slots a request will fill later), internal fragmentation (slots it never fills), the rest
(external fragmentation and free). max_batch is the largest number of requests running at once.
"""
from __future__ import annotations

import argparse
import bisect
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from tqdm import tqdm

from benchmarks.common import (
    add_common_args,
    command_line,
    new_figure,
    print_result,
    sharegpt_like_lengths,
    write_results,
)
from engine.kv.block_manager import BlockManager, PrefixHit
from engine.kv.block_pool import BlockPool

BLOCK_SIZE = 16
MAX_MODEL_LEN = 2048
PAPER = {"Orca (Max)": 0.204, "Orca (Pow2)": 0.268, "Orca (Oracle)": 0.382, "vLLM": 0.963}  # figure 2


@dataclass
class Replay:
    """What one allocator did with the trace, sampled every step."""

    name: str
    utilization: list[float] = field(default_factory=list)   # live / reserved, every step
    # while requests wait: shares of the whole memory [token states, reservation, internal frag, rest]
    breakdown: list[tuple[float, float, float, float]] = field(default_factory=list)
    batch: list[int] = field(default_factory=list)
    steps: int = 0
    preemptions: int = 0

    def summary(self) -> dict[str, float]:
        b = [sum(col) / len(col) for col in zip(*self.breakdown)] if self.breakdown else [0.0] * 4
        return {"utilization": _mean(self.utilization), "of_memory": b[0], "reservation": b[1],
                "internal_fragmentation": b[2], "external_fragmentation_and_free": b[3],
                "max_batch": max(self.batch), "mean_batch": _mean(self.batch), "steps": self.steps,
                "preemptions": self.preemptions}


def _mean(xs: Sequence[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def make_trace(n: int, seed: int) -> list[tuple[int, int]]:
    """(prompt, output) lengths, prompt + output <= MAX_MODEL_LEN."""
    out = []
    for p, o in sharegpt_like_lengths(n, seed, max_len=MAX_MODEL_LEN):
        p = min(p, MAX_MODEL_LEN - 1)
        out.append((p, max(1, min(o, MAX_MODEL_LEN - p))))
    return out


def next_pow2(x: int) -> int:
    return 1 << max(0, x - 1).bit_length()


def reservation(policy: str, prompt: int, output: int) -> int:
    if policy == "Orca (Max)":
        return MAX_MODEL_LEN
    if policy == "Orca (Pow2)":
        return min(MAX_MODEL_LEN, prompt + next_pow2(output))
    if policy == "Orca (Oracle)":
        return prompt + output
    raise ValueError(policy)


class FirstFit:
    """Contiguous chunks of one address range, first fit; holes merge with their neighbours on free."""

    def __init__(self, size: int) -> None:
        self.holes: list[tuple[int, int]] = [(0, size)]   # (start, length), sorted by start

    def alloc(self, n: int) -> int | None:
        for i, (start, length) in enumerate(self.holes):
            if length >= n:
                if length == n:
                    del self.holes[i]
                else:
                    self.holes[i] = (start + n, length - n)
                return start
        return None

    def free(self, start: int, n: int) -> None:
        i = bisect.bisect(self.holes, (start, n))
        self.holes.insert(i, (start, n))
        if i + 1 < len(self.holes) and start + n == self.holes[i + 1][0]:     # merge right
            self.holes[i] = (start, n + self.holes[i + 1][1])
            del self.holes[i + 1]
        if i > 0 and self.holes[i - 1][0] + self.holes[i - 1][1] == start:   # merge left
            self.holes[i - 1] = (self.holes[i - 1][0], self.holes[i - 1][1] + self.holes[i][1])
            del self.holes[i]


def replay_contiguous(trace: Sequence[tuple[int, int]], memory_tokens: int, policy: str) -> Replay:
    rep = Replay(policy)
    heap = FirstFit(memory_tokens)
    waiting = deque(range(len(trace)))
    running: dict[int, tuple[int, int, int]] = {}    # id -> (start, reserved, live)
    while waiting or running:
        while waiting:                                # FCFS: the head blocks the rest
            rid = waiting[0]
            p, o = trace[rid]
            size = reservation(policy, p, o)
            start = heap.alloc(size)
            if start is None:
                if not running:
                    raise RuntimeError(f"request {rid} ({size} slots) can never fit {memory_tokens} slots")
                break
            waiting.popleft()
            running[rid] = (start, size, p)           # prefill: the prompt's KV
        _sample(rep, trace, running.items(), memory_tokens, bool(waiting),
                lambda item: (item[1][2], item[1][1]))
        for rid in list(running):                     # decode: one token each; finish at the true length
            start, size, live = running[rid]
            p, o = trace[rid]
            if live + 1 >= p + o:
                del running[rid]
                heap.free(start, size)
            else:
                running[rid] = (start, size, live + 1)
    return rep


def replay_paged(trace: Sequence[tuple[int, int]], memory_tokens: int) -> Replay:
    rep = Replay("prefixserve (paged)")
    b = BLOCK_SIZE
    pool = BlockPool(memory_tokens // b)
    manager = BlockManager(pool, b, "memory-benchmark", enable_prefix_caching=False)
    waiting = deque(range(len(trace)))
    live: dict[int, int] = {}                         # id -> tokens in the cache; insertion order = age
    while waiting or live:
        # 1. running sequences grow by one token (the token sampled last step); preempt the youngest if short
        preempted = False
        for rid in list(live):
            if rid not in live:
                continue
            while not manager.grow(rid, live[rid] + 1):
                victim = next(reversed(live))
                manager.free(victim)
                del live[victim]
                waiting.appendleft(victim)
                rep.preemptions += 1
                preempted = True
                if victim == rid:
                    break
            if rid in live:
                live[rid] += 1
        # 2. admissions, FCFS, not in a step that preempted (as the engine's scheduler)
        while waiting and not preempted:
            rid = waiting[0]
            p, o = trace[rid]
            if not manager.allocate(rid, range(p), PrefixHit((), 0), p):
                manager.free(rid)
                if not live:
                    raise RuntimeError(f"request {rid} can never fit {memory_tokens} slots")
                break
            waiting.popleft()
            live[rid] = p                              # a preempted request recomputes from scratch
        _sample(rep, trace, live.items(), memory_tokens, bool(waiting),
                lambda item: (item[1], manager.num_blocks(item[0]) * b))
        for rid in [r for r, n in live.items() if n >= sum(trace[r]) - 1]:
            manager.free(rid)
            del live[rid]
    assert pool.stats().used == 0, "the replay leaked blocks"
    return rep


def _sample(rep: Replay, trace: Sequence[tuple[int, int]], items, memory_tokens: int, memory_bound: bool,
            live_reserved) -> None:
    items = list(items)
    rep.steps += 1
    rep.batch.append(len(items))
    live = reserved = future = 0
    for item in items:
        lv, rs = live_reserved(item)
        live, reserved = live + lv, reserved + rs
        future += min(rs, sum(trace[item[0]]) - 1) - lv    # slots this request will still fill
    if reserved:
        rep.utilization.append(live / reserved)
    if memory_bound:
        internal = reserved - live - future
        rep.breakdown.append((live / memory_tokens, future / memory_tokens, internal / memory_tokens,
                              (memory_tokens - reserved) / memory_tokens))


def plot(results: dict[str, dict[str, float]]):
    fig, (ax1, ax2) = new_figure(2, width=6.2)
    names = list(results)
    short = [n.replace(" (paged)", "\n(paged)").replace("Orca ", "Orca\n") for n in names]
    parts = [("of_memory", "token states", "tab:green"), ("reservation", "reservation", "tab:orange"),
             ("internal_fragmentation", "internal fragmentation", "tab:red"),
             ("external_fragmentation_and_free", "external fragmentation & free", "tab:gray")]
    bottom = [0.0] * len(names)
    for key, label, color in parts:
        vals = [100 * results[n][key] for n in names]
        ax1.bar(short, vals, bottom=bottom, label=label, color=color)
        bottom = [a + v for a, v in zip(bottom, vals)]
    for i, n in enumerate(names):
        paper = PAPER["vLLM" if "paged" in n else n]
        ax1.plot([i - 0.4, i + 0.4], [100 * paper] * 2, "k--", lw=1)
    ax1.set_ylabel("% of KV memory (while requests wait)")
    ax1.set_title("KV memory breakdown (dashed: vLLM paper, fig. 2)")
    ax1.legend(fontsize=7, loc="upper center", ncol=2)
    ax1.set_ylim(0, 125)
    ax2.bar(short, [100 * results[n]["utilization"] for n in names], color="tab:blue")
    for i, n in enumerate(names):
        ax2.text(i, 100 * results[n]["utilization"] + 1, f"{100 * results[n]['utilization']:.1f}%\n"
                 f"max batch {results[n]['max_batch']}", ha="center", fontsize=7)
    ax2.set_ylabel("live token slots / reserved slots (%)")
    ax2.set_title("KV utilization, mean over steps")
    ax2.set_ylim(0, 115)
    return fig


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.offline.memory") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--num-requests", type=int, default=None, help="trace length (default 1000, --quick 300)")
    ap.add_argument("--memory-tokens", type=int, default=16384,
                    help="KV memory in token slots, the same for every allocator (default 16384: about what "
                         "OPT-13B has on an A100-40GB in the paper)")
    args = ap.parse_args(argv)
    n = args.num_requests or (300 if args.quick else 1000)
    trace = make_trace(n, args.seed)
    policies = ["Orca (Max)", "Orca (Pow2)", "Orca (Oracle)"]
    results: dict[str, dict[str, float]] = {}
    with tqdm(total=1 + len(policies), desc="memory") as bar:
        bar.set_postfix_str("paged")
        results["prefixserve (paged)"] = replay_paged(trace, args.memory_tokens).summary()
        bar.update()
        for policy in policies:
            bar.set_postfix_str(policy)
            results[policy] = replay_contiguous(trace, args.memory_tokens, policy).summary()
            bar.update()

    mean_in = sum(p for p, _ in trace) / n
    mean_out = sum(o for _, o in trace) / n
    rows = ["| allocator | KV utilization (live / reserved) | token states, % of memory | paper (fig. 2) | "
            "max batch | mean batch | steps | preemptions |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in results.items():
        paper = PAPER["vLLM" if "paged" in name else name]
        rows.append(f"| {name} | {r['utilization']:.3f} | {100 * r['of_memory']:.1f}% | {100 * paper:.1f}% | "
                    f"{r['max_batch']} | {r['mean_batch']:.1f} | {r['steps']} | {r['preemptions']} |")
    table = "\n".join(rows) + (
        f"\n\n{n} requests, mean prompt {mean_in:.0f} / output {mean_out:.0f} tokens (ShareGPT-like, seed "
        f"{args.seed}), max_model_len {MAX_MODEL_LEN}, {args.memory_tokens} token slots of KV memory for every "
        f"allocator, block size {BLOCK_SIZE}. KV utilization: mean over every step of live token slots / slots "
        "reserved by running requests. Token states, % of memory: live slots / all KV memory over the steps "
        "where requests were waiting (the paper's figure 2 measure, which also charges external "
        "fragmentation and unreservable memory).")
    print(table)
    paged, cmax = results["prefixserve (paged)"], results["Orca (Max)"]
    result = {"paged_utilization": round(paged["utilization"], 4),
              "contiguous_utilization": round(cmax["utilization"], 4),
              "pow2_utilization": round(results["Orca (Pow2)"]["utilization"], 4),
              "oracle_utilization": round(results["Orca (Oracle)"]["utilization"], 4),
              "max_batch_paged": paged["max_batch"], "max_batch_contiguous": cmax["max_batch"],
              "max_batch_pow2": results["Orca (Pow2)"]["max_batch"],
              "max_batch_oracle": results["Orca (Oracle)"]["max_batch"],
              "paged_of_memory": round(paged["of_memory"], 4), "contiguous_of_memory": round(cmax["of_memory"], 4),
              "pow2_of_memory": round(results["Orca (Pow2)"]["of_memory"], 4),
              "oracle_of_memory": round(results["Orca (Oracle)"]["of_memory"], 4)}
    write_results("memory", table, {"result": result, "allocators": results, "num_requests": n,
                                    "memory_tokens": args.memory_tokens, "block_size": BLOCK_SIZE,
                                    "max_model_len": MAX_MODEL_LEN, "paper_fig2": PAPER},
                  out_dir=args.out, figure=plot(results), command=command_line(prog, argv))
    print_result(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
