"""Fairness between tenants: one key's burst of long cold warm-ups against another key's short completion
(issue 34, item 6).

    prefixserve bench fairness [--quick] [--model M] [--burst N] [--prompt-words W] [--rounds R]
                               [--server-args "--max-num-batched-tokens 64 ..."]

One server with two API keys. Tenant B's 4-token completion (ignore_eos) is timed alone; then tenant A sends a
burst of N cold warm-ups at once (`max_tokens: 0` with a `prompt_cache_key` each: ~W words, ~1,300 tokens on the
built-in model, every prompt distinct), and `--delay` seconds later B sends the same completion. Reported: B's
latency alone and during the burst, and how many of A's warm-ups had finished when B's answer came (FCFS
across tenants answered B only after the whole burst). Each round, what is left of A's burst is then cancelled.
"""
from __future__ import annotations

import argparse
import asyncio
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.common import add_common_args, command_line, new_figure, print_result, write_results
from benchmarks.served.deployment import ROOT, free_port, stop_process, wait_ready

KEYS = {"A": "tenant-a-key", "B": "tenant-b-key"}


def words(i: int, n: int) -> str:
    return " ".join(f"record {i} line {j} holds item {(i * 7919 + j) % 1000}." for j in range(n // 6))


async def short(session: aiohttp.ClientSession, url: str) -> float:
    t0 = time.perf_counter()
    async with session.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEYS['B']}"},
                            json={"prompt": "What is the capital of France?", "max_tokens": 4, "temperature": 0,
                                  "ignore_eos": True}) as r:
        r.raise_for_status()
        assert (await r.json())["usage"]["completion_tokens"] == 4
    return time.perf_counter() - t0


async def idle(session: aiohttp.ClientSession, url: str) -> None:
    """Until the server runs and queues nothing (what a cancelled burst left: its aborts, the leases it asked for)."""
    while True:
        async with session.get(f"{url}/metrics", headers={"Authorization": f"Bearer {KEYS['B']}"}) as r:
            text = await r.text()
        busy = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith(("vllm:num_requests_running", "vllm:num_requests_waiting")))
        if not busy:
            return
        await asyncio.sleep(0.5)


async def round_(url: str, args: argparse.Namespace, r: int) -> dict[str, Any]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        await idle(session, url)
        alone = await short(session, url)
        done: list[float] = []

        async def warm(i: int) -> None:
            async with session.post(f"{url}/v1/completions", headers={"Authorization": f"Bearer {KEYS['A']}"},
                                    json={"prompt": words(r * 1000 + i, args.prompt_words), "max_tokens": 0,
                                          "prompt_cache_key": f"round{r}-{i}"}) as resp:
                resp.raise_for_status()
                await resp.read()
                done.append(time.perf_counter())
        burst = [asyncio.create_task(warm(i)) for i in range(args.burst)]
        await asyncio.sleep(args.delay)
        during = await short(session, url)
        answered = time.perf_counter()
        finished = sum(1 for t in done if t <= answered)
        for task in burst:
            task.cancel()
        await asyncio.gather(*burst, return_exceptions=True)
    return {"alone_s": alone, "during_s": during, "burst_finished_before": finished}


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.served.fairness") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--burst", type=int, default=None, help="tenant A's warm-ups (default 48, --quick 16)")
    ap.add_argument("--prompt-words", type=int, default=600, help="words per warm-up prompt (~1,300 tokens)")
    ap.add_argument("--delay", type=float, default=1.0, help="seconds between the burst and B's request")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3, --quick 1)")
    ap.add_argument("--server-args", default="", help="more flags for the server, in one string")
    args = ap.parse_args(argv)
    args.burst = args.burst or (16 if args.quick else 48)
    args.rounds = args.rounds or (1 if args.quick else 3)
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-fairness-") as tmp:
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "service", "serve", "--host", "127.0.0.1", "--port", str(port),
               "--api-key", ",".join(KEYS.values()), "--log-level", "warning"]
        if args.model:
            cmd += ["--model", args.model]
        cmd += shlex.split(args.server_args)
        with open(Path(tmp) / "server.log", "wb") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_ready(f"{url}/health", proc, "the server")
            for r in range(args.rounds):
                rows.append(asyncio.run(round_(url, args, r)))
                print(rows[-1], file=sys.stderr)
        finally:
            stop_process(proc)
    result = {k: round(statistics.median(row[k] for row in rows), 3) for k in rows[0]}
    table = (f"Server flags: `{args.server_args or '(defaults)'}`. Tenant A: a burst of {args.burst} cold "
             f"warm-ups (max_tokens 0, prompt_cache_key, ~{args.prompt_words} "
             f"words each); tenant B: one 4-token completion {args.delay:g} s later. Medians of {args.rounds} "
             "round(s).\n\n| B alone | B during A's burst | A's warm-ups finished before B's answer |\n"
             "|---:|---:|---:|\n"
             f"| {result['alone_s']:.2f} s | {result['during_s']:.2f} s | {result['burst_finished_before']:g} of "
             f"{args.burst} |\n")
    print(table)
    fig, (ax,) = new_figure(1)
    ax.bar(["B alone", "B during A's burst"], [result["alone_s"], result["during_s"]])
    ax.set_ylabel("seconds")
    write_results("fairness", table, {**result, "rows": rows, "burst": args.burst}, args.out, fig,
                  command_line(prog, argv))
    print_result(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
