"""prefixserve beside its peers on this machine: the same weights, prompts, client and output lengths.

    prefixserve bench peers [--rounds 2] [--systems prefixserve vllm llama.cpp] [--workloads all|basic|extended|NAME...]
        [--vllm-python PATH] [--llama-cpp-python PATH] [--guidellm PATH] [--smoke] [--out DIR]
        (or PREFIXSERVE_PEER_VLLM / _LLAMA_CPP, PREFIXSERVE_GUIDELLM)

Each system's OpenAI server is started on loopback, one at a time, and driven by this process (servers.py).
Workloads (greedy; every request generates exactly its max_tokens: `ignore_eos` where the server has it,
`min_tokens` where it does not):

    basic     throughput, single, shared, shared_named (loads.py), loadgen, guidellm (external.py)
    extended  long3k, long8k, many_systems, sessions (loads.py), contention (contention.py), onednn (onednn.py)

`--workloads` takes names and groups (`all`, the default, is both groups). Systems alternate within each
round (the order reversed every other round) and every figure is the median over rounds; the 1-minute load
average is recorded before each workload. `onednn` is not timed: it runs once per system after the rounds.
A peer that is not installed or does not start is reported absent, with the reason: never replaced by a
figure recorded elsewhere. The CPU (name, family/model, AVX2 / AVX-512 / BF16 / VNNI / AMX flags) heads the
table. `--smoke` cuts every workload's request count (prompts.SMOKE) to check the harness end to end: its
figures are not comparable with a full run's, and its report says so.
Writes peers.md, peers.json and peers.png (ours vs each peer, per figure) into --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.common import command_line, cpu_info, cpu_line, new_figure, print_result, write_results
from benchmarks.served.peers import onednn
from benchmarks.served.peers.client import run_requests
from benchmarks.served.peers.contention import run_contention
from benchmarks.served.peers.external import run_guidellm, run_loadgen
from benchmarks.served.peers.loads import (
    run_long,
    run_many,
    run_named,
    run_sessions,
    run_shared,
    run_single,
    run_throughput,
)
from benchmarks.served.peers.prompts import SMOKE, Sizes, Workload, workload
from benchmarks.served.peers.report import FIGURES, medians, report
from benchmarks.served.peers.servers import SYSTEMS, Server, cores, make_servers, peer_python

BASIC = ("throughput", "single", "shared", "shared_named", "loadgen", "guidellm")
EXTENDED = ("long3k", "long8k", "many_systems", "sessions", "contention", "onednn")
GROUPS = {"all": BASIC + EXTENDED, "basic": BASIC, "extended": EXTENDED}


def selected_workloads(names: list[str]) -> list[str]:
    """Names and groups, expanded, in the order they run, each once."""
    chosen = {n for name in names for n in GROUPS.get(name, (name,))}
    return [n for n in GROUPS["all"] if n in chosen]


def run_system(server: Server, w: Workload, args: argparse.Namespace, vllm_python: str | None, checkpoint: str,
               log_dir: Path, name: str) -> dict[str, Any]:
    """Starts the server, warms it (2 short requests), runs every timed workload selected, stops it."""
    figures: dict[str, Any] = {"start_s": server.start(log_dir), "load": {}}
    try:
        warm = [("/v1/completions", {"prompt": w.single[0], "max_tokens": 8})] * 2
        asyncio.run(run_requests(server, warm, 1, "warm-up"))
        steps: dict[str, Callable[[], dict[str, float]]] = {
            "throughput": lambda: run_throughput(server, w),
            "single": lambda: run_single(server, w),
            "shared": lambda: run_shared(server, w.shared, "shared"),
            "long3k": lambda: run_long(server, w, "long3k"),
            "long8k": lambda: run_long(server, w, "long8k"),
            "many_systems": lambda: run_many(server, w),
            "sessions": lambda: run_sessions(server, w),
            "contention": lambda: run_contention(server, w),
        }
        if server.name == "prefixserve":
            steps["shared_named"] = lambda: run_named(server, w, name)
        if server.name == "llama.cpp":
            if "loadgen" in args.workloads:
                # vllm bench serve always sends vLLM's `ignore_eos` and `repetition_penalty`, which
                # llama-cpp-python's server refuses (400 on every request, measured): no figure for it
                figures.setdefault("failed", {})["loadgen"] = ("vllm bench serve sends ignore_eos and "
                                                               "repetition_penalty, which llama-cpp-python's "
                                                               "server refuses (400)")
        else:
            steps["loadgen"] = lambda: run_loadgen(server, w.loadgen_seed, vllm_python, checkpoint,
                                                   args.loadgen_prompts)
            # one request at a time on llama.cpp (its server queues them): no guidellm there
            steps["guidellm"] = lambda: run_guidellm(server, args.guidellm, checkpoint)
        for step in args.workloads:
            if step not in steps:
                continue
            figures["load"][step] = os.getloadavg()[0]
            try:
                figures |= steps[step]()
            except RuntimeError as exc:         # this workload only: the system's other figures stand
                print(f"{server.name}, {step}: {exc}", file=sys.stderr)
                figures.setdefault("failed", {})[step] = str(exc)[:500]
    finally:
        server.stop()
    return figures


def served_model(system: str, gguf: str, checkpoint: str, vllm_dtype: str = "bfloat16") -> str:
    """What each system loads: vLLM the float32 checkpoint our loader made (in --vllm-dtype), the others the GGUF."""
    return f"{Path(checkpoint).name} in {vllm_dtype}" if system == "vllm" else Path(gguf).name


def model_context(checkpoint: str) -> int:
    """The model's positions (config.json's max_position_embeddings): every server is given all of them."""
    return int(json.loads((Path(checkpoint) / "config.json").read_text())["max_position_embeddings"])


def main(argv: list[str] | None = None, prog: str = "prefixserve bench peers") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--workloads", nargs="+", default=["all"], choices=[*GROUPS, *GROUPS["all"]],
                    help="workloads and groups: all (default), basic, extended, or names")
    ap.add_argument("--guidellm", default=os.environ.get("PREFIXSERVE_GUIDELLM"),
                    help="guidellm's executable, in its own venv (or PREFIXSERVE_GUIDELLM); no guidellm figures "
                         "without it")
    ap.add_argument("--vllm-python", default=None, help="the vLLM venv's python (or PREFIXSERVE_PEER_VLLM)")
    ap.add_argument("--vllm-dtype", default="bfloat16", choices=["bfloat16", "float32"],
                    help="vLLM's --dtype (bfloat16, as vLLM's CPU docs advise; float32 is faster where oneDNN "
                         "has no bfloat16 GEMM, e.g. AVX2 CPUs)")
    ap.add_argument("--llama-cpp-python", default=None, help="llama-cpp-python's venv python "
                                                             "(or PREFIXSERVE_PEER_LLAMA_CPP)")
    ap.add_argument("--prefixserve-args", nargs=argparse.REMAINDER, default=[],
                    help="extra `prefixserve serve` flags (last on the line)")
    ap.add_argument("--loadgen-prompts", type=int, default=60)
    ap.add_argument("--model", default=None,
                    help="a GGUF (default: the built-in model's), or a checkpoint directory (then no llama.cpp); "
                         "every system serves it")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="one round")
    ap.add_argument("--smoke", action="store_true",
                    help="one round, few requests per workload: checks the harness, its figures are not results")
    args = ap.parse_args(argv)
    # the servers run in sessions of their own: on SIGTERM unwind (each `finally` stops its server) rather than die
    previous = signal.signal(signal.SIGTERM, _terminated)
    try:
        return run(args, argv, prog)
    finally:
        signal.signal(signal.SIGTERM, previous)


def _terminated(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


def run(args: argparse.Namespace, argv: list[str], prog: str) -> int:
    args.workloads = selected_workloads(args.workloads)
    sizes = SMOKE if args.smoke else Sizes()
    if args.quick or args.smoke:
        args.rounds = 1
    if args.smoke:
        args.loadgen_prompts = min(args.loadgen_prompts, 8)
    from transformers import AutoTokenizer

    from engine.models.default import default_model_path
    from engine.models.loader import resolve_model_path

    gguf = args.model or str(default_model_path())
    checkpoint = str(resolve_model_path(gguf))           # converts (and caches) it on first use
    context = model_context(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    servers, absent = make_servers(args, checkpoint, gguf, context)
    vllm_python = servers["vllm"].argv[0] if "vllm" in servers else peer_python(args.vllm_python,
                                                                                 "PREFIXSERVE_PEER_VLLM")[0]
    if "loadgen" in args.workloads and vllm_python is None:
        absent["vllm bench serve"] = "the load generator needs the vLLM venv"
    if "guidellm" in args.workloads and args.guidellm is None:
        absent["guidellm"] = "not installed (--guidellm PATH: `pip install guidellm` in a venv of its own)"
    log_dir = Path(tempfile.mkdtemp(prefix="prefixserve-peers-"))
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in servers}
    first: Workload | None = None
    timed = [n for n in args.workloads if n != "onednn"]
    for r in range(args.rounds if timed else 0):
        w = workload(tokenizer, args.seed + r, context, sizes)            # fresh prompts every round
        first = first or w
        order = list(servers) if r % 2 == 0 else list(servers)[::-1]
        for s in order:
            try:
                figures = run_system(servers[s], w, args, vllm_python, checkpoint, log_dir, f"sys-{r}")
            except RuntimeError as exc:
                print(f"{s}: {exc}", file=sys.stderr)
                absent[s] = f"failed in round {r + 1}: {exc}"
                continue
            runs[s].append({"round": r, **figures})
            print(f"round {r + 1} {s}: " + json.dumps({k: round(v, 2) for k, v in figures.items()
                                                       if isinstance(v, float)}), file=sys.stderr)
    kernels: dict[str, dict[str, Any]] = {}
    if "onednn" in args.workloads:
        w = first or workload(tokenizer, args.seed, context, sizes)
        first = w
        for s, server in servers.items():
            try:
                kernels[s] = onednn.run_onednn(server, w, log_dir)
            except RuntimeError as exc:
                print(f"{s}, onednn: {exc}", file=sys.stderr)
                kernels[s] = {"error": str(exc)[:500]}
    ran = [s for s in SYSTEMS if runs.get(s)]
    table, ratios = report(runs, ran, {s: why for s, why in absent.items() if s not in ran or "failed" in why})
    failures = {(s, step): why for s, fs in runs.items() for f in fs for step, why in f.get("failed", {}).items()}
    for (s, step), why in failures.items():         # once each, however many rounds it failed in
        table += f"\n\n**{s}, {step}: failed** ({why[:300]})"
    cpu = cpu_info()
    loads = {s: [f["load"] for f in fs] for s, fs in runs.items()}
    head = f"CPU: {cpu_line(cpu, len(cores()))}.\n\n"
    if args.smoke:
        head += ("**Smoke run** (`--smoke`: request counts cut to " + json.dumps(asdict(sizes)) +
                 "): it checks the harness; its figures are not results and the labels' counts do not apply.\n\n")
    notes = (f"\n\nMedians over {args.rounds if timed else 0} round(s), systems alternating; 1-minute load average "
             f"before each workload: " + "; ".join(f"{s} {json.dumps(v)}" for s, v in loads.items()) +
             "\n\nVersions: " + ", ".join(f"{s} {servers[s].version}" for s in servers) +
             ". Model: " + "; ".join(f"{s} {served_model(s, gguf, checkpoint, args.vllm_dtype)}" for s in servers) +
             f"; every server given the model's {context:,} positions.")
    longs = {k: v for k, v in (first.system_tokens if first else {}).items() if k in timed}
    if longs:
        notes += " Long system prompts: " + ", ".join(f"{k} {v:,} tokens" for k, v in longs.items()) + "."
    if kernels:
        notes += "\n\n### oneDNN kernels by GEMM shape (ONEDNN_VERBOSE=1, a short run per system)\n\n"
        notes += onednn.table(kernels)
    fig, (ax,) = new_figure(width=9.0, height=4.5)
    keys = [k for k in FIGURES if any(ratios[p].get(k) for p in ratios)]
    for i, p in enumerate(ratios):
        ax.bar([x + 0.4 * i for x in range(len(keys))], [ratios[p].get(k) or 0 for k in keys], 0.4,
               label=f"ours vs {p}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([x + 0.2 for x in range(len(keys))], [k.removesuffix("_ms").removesuffix("_tok_s") for k in keys],
                  rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("times better (> 1: ours wins)")
    if ratios:
        ax.legend()
    payload = {"medians": medians(runs),
               "ratios": ratios, "runs": runs, "absent": absent, "cpu": cpu, "onednn": kernels,
               "versions": {s: servers[s].version for s in servers}, "rounds": args.rounds, "context": context,
               "workloads": args.workloads, "sizes": asdict(sizes), "smoke": args.smoke,
               "system_tokens": first.system_tokens if first else {}}
    write_results("peers", head + table + notes, payload, args.out, fig, command_line(prog, argv))
    print_result({"ratios": ratios, "absent": absent, "cpu": cpu_line(cpu), "smoke": args.smoke})
    return 0
