"""Isolation: can one tenant tell, from its own answers, which prompt another tenant sent? (issue 25)

    prefixserve bench isolation [--quick] [--model M] [--secrets N] [--guesses K] [--rounds R]

The attack (after InputSnatch, 2024, and vLLM's security notes on prefix caching): tenant A sends N private
templated prompts, each with a secret (a 4-digit PIN) early in a long customer record. Tenant B, with its
own key, then probes K guesses per secret (the right one among K-1 wrong ones, in a shuffled order), each a
streamed completion of the same template, and measures its time to first token and the cached_tokens its
usage reports. A classifier that scores a guess by -TTFT (or by cached_tokens) tells the right guess from
the wrong ones with ROC AUC = P(score(right) > score(wrong)) (ties count half): 0.5 is a coin, 1.0 always.

Two servers run the same attack: `--cache-isolation shared` (one cache for every key: what vLLM, SGLang and
TGI do without a client-sent cache_salt) and `--cache-isolation tenant` (ours by default: a salt derived from
the tenant). Target: AUC <= 0.55 isolated, against ~0.99 shared.

The cost of isolation at 0% cross-tenant sharing: the same two servers take turns (rounds alternate, the
idle one waits) serving a throughput load with no prompt shared between tenants: R rounds of 2 tenants x
--requests/2 distinct prompts at concurrency 8; output tok/s, median ratio isolated / shared (target >= 0.99).
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

from benchmarks.common import add_common_args, command_line, new_figure, print_result, sse_events, write_results
from benchmarks.served.deployment import ROOT, free_port, stop_process, wait_ready

KEYS = {"A": "tenant-a-key", "B": "tenant-b-key"}
MODES = ("shared", "tenant")
RECORD = ("The customer holds a gold plan, pays monthly, prefers email, and "
          "last called about the March invoice, which was paid late because of a bank holiday; the agent "
          "waived the fee and noted that the next statement goes to the new address on file. ")


def prompt(n: int, pin: int, tail_repeats: int) -> str:
    """The secret in the first KV block, so that B's own probes of one record share no block either."""
    return f"PIN {pin:04d}, customer {n}. " + RECORD * tail_repeats + "Summary:"


def roc_auc(right: list[float], wrong: list[float]) -> float:
    """P(a right guess scores above a wrong one), ties half: the Mann-Whitney form of ROC AUC."""
    pairs = [(r > w) + 0.5 * (r == w) for r in right for w in wrong]
    return sum(pairs) / len(pairs)


class Server:
    def __init__(self, mode: str, args: argparse.Namespace, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "service", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--api-key", ",".join(KEYS.values()), "--cache-isolation", mode, "--served-model-name", "m",
               "--log-level", "warning", "--max-num-waiting", "100000"]
        if args.model:
            cmd += ["--model", args.model]
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)

    def stop(self) -> None:
        stop_process(self.proc, 30)


async def complete(session: aiohttp.ClientSession, url: str, key: str, text: str, max_tokens: int) -> dict[str, Any]:
    """One streamed completion: its TTFT (s), cached_tokens and output tokens."""
    body = {"model": "m", "prompt": text, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft: float | None = None
    usage: dict[str, Any] = {}
    async with session.post(f"{url}/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        async for chunk in sse_events(r):
            if chunk.get("choices") and ttft is None:
                ttft = time.perf_counter() - start
            usage = chunk.get("usage") or usage
    return {"ttft": ttft or 0.0, "cached": usage["prompt_tokens_details"]["cached_tokens"],
            "output": usage["completion_tokens"]}


async def attack(url: str, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    """A sends its secrets, B probes; the AUCs of B's two classifiers."""
    secrets = [rng.randrange(10000) for _ in range(args.secrets)]
    probes = []
    for n, pin in enumerate(secrets):
        decoys = rng.sample([p for p in range(10000) if p != pin], args.guesses - 1)
        probes += [(n, guess, guess == pin) for guess in [pin, *decoys]]
    rng.shuffle(probes)
    async with aiohttp.ClientSession() as session:
        for n, pin in enumerate(secrets):
            await complete(session, url, KEYS["A"], prompt(n, pin, args.tail), 1)
        seen = [(is_right, await complete(session, url, KEYS["B"], prompt(n, guess, args.tail), 1))
                for n, guess, is_right in tqdm(probes, desc="probes", leave=False)]
    right = [o for r, o in seen if r]
    wrong = [o for r, o in seen if not r]
    return {"auc_ttft": roc_auc([-o["ttft"] for o in right], [-o["ttft"] for o in wrong]),
            "auc_cached": roc_auc([o["cached"] for o in right], [o["cached"] for o in wrong]),
            "ttft_right": [o["ttft"] for o in right], "ttft_wrong": [o["ttft"] for o in wrong],
            "cached_right": statistics.median(o["cached"] for o in right),
            "cached_wrong": statistics.median(o["cached"] for o in wrong)}


async def throughput(url: str, args: argparse.Namespace, round_no: int) -> float:
    """Output tok/s of a load where no prompt is shared between the two tenants (nor within one)."""
    jobs = [(KEYS["AB"[i % 2]], f"Round {round_no} request {i}: " + RECORD * 2)
            for i in range(args.requests)]
    sem = asyncio.Semaphore(8)

    async def one(session: aiohttp.ClientSession, key: str, text: str) -> int:
        async with sem:
            return int((await complete(session, url, key, text, args.output_len))["output"])

    async with aiohttp.ClientSession() as session:
        start = time.perf_counter()
        tokens = await asyncio.gather(*(one(session, k, t) for k, t in jobs))
        return sum(tokens) / (time.perf_counter() - start)


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.served.isolation") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--secrets", type=int, default=None, help="tenant A's private prompts (default 8, --quick 3)")
    ap.add_argument("--guesses", type=int, default=None, help="B's guesses per secret (default 12, --quick 6)")
    ap.add_argument("--tail", type=int, default=3, help="record repeats after the PIN (the prompt's length)")
    ap.add_argument("--rounds", type=int, default=None, help="throughput rounds per mode (default 3, --quick 1)")
    ap.add_argument("--requests", type=int, default=None, help="per throughput round (default 32, --quick 8)")
    ap.add_argument("--output-len", type=int, default=32)
    args = ap.parse_args(argv)
    for name, full, quick in (("secrets", 8, 3), ("guesses", 12, 6), ("rounds", 3, 1), ("requests", 32, 8)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    rows: dict[str, dict[str, Any]] = {}
    rates: dict[str, list[float]] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory(prefix="bench-isolation-") as tmp:
        servers = {m: Server(m, args, Path(tmp) / f"{m}.log") for m in MODES}
        try:
            for m, s in servers.items():
                wait_ready(f"{s.url}/health", s.proc, f"the {m} server")
            for m in tqdm(MODES, desc="attacks"):
                rows[m] = asyncio.run(attack(servers[m].url, args, random.Random(args.seed)))
            for r in tqdm(range(args.rounds), desc="throughput rounds"):
                for m in (MODES if r % 2 == 0 else MODES[::-1]):
                    rates[m].append(asyncio.run(throughput(servers[m].url, args, r)))
        finally:
            for s in servers.values():
                s.stop()
    ratio = statistics.median(t / s for t, s in zip(rates["tenant"], rates["shared"]))
    table = markdown(args, rows, rates, ratio)
    print(table)
    fig, (ax_auc, ax_ttft) = new_figure(2, width=5.5)
    x = range(len(MODES))
    ax_auc.bar([i - 0.2 for i in x], [rows[m]["auc_ttft"] for m in MODES], 0.4, label="by TTFT")
    ax_auc.bar([i + 0.2 for i in x], [rows[m]["auc_cached"] for m in MODES], 0.4, label="by cached_tokens")
    ax_auc.axhline(0.55, color="gray", ls="--", lw=1, label="target 0.55")
    ax_auc.set_xticks(list(x), [f"--cache-isolation {m}" for m in MODES])
    ax_auc.set_ylim(0, 1.05)
    ax_auc.set_ylabel("ROC AUC of B's guess classifier")
    ax_auc.legend(fontsize=8)
    for i, m in enumerate(MODES):
        ax_ttft.scatter([i - 0.1] * len(rows[m]["ttft_right"]), [t * 1000 for t in rows[m]["ttft_right"]],
                        color="C3", s=14, label="right guess" if i == 0 else None)
        ax_ttft.scatter([i + 0.1] * len(rows[m]["ttft_wrong"]), [t * 1000 for t in rows[m]["ttft_wrong"]],
                        color="C0", s=8, alpha=0.5, label="wrong guess" if i == 0 else None)
    ax_ttft.set_xticks(list(x), list(MODES))
    ax_ttft.set_ylabel("B's TTFT (ms)")
    ax_ttft.legend(fontsize=8)
    result = {f"auc_ttft_{m}": round(rows[m]["auc_ttft"], 3) for m in MODES}
    result |= {f"auc_cached_{m}": round(rows[m]["auc_cached"], 3) for m in MODES}
    result |= {"throughput_ratio": round(ratio, 3), "throughput": {m: [round(v, 1) for v in rates[m]] for m in MODES}}
    write_results("isolation", table, {**result, "rows": rows}, args.out, fig, command_line(prog, argv))
    print_result(result)
    return 0


def markdown(args: argparse.Namespace, rows: dict[str, dict[str, Any]], rates: dict[str, list[float]],
             ratio: float) -> str:
    lines = [f"Tenant A sent {args.secrets} private prompts (a PIN early in a customer record); tenant B probed "
             f"{args.guesses} guesses per secret (1 right), max_tokens 1, streamed, one at a time.", "",
             "| --cache-isolation | AUC by TTFT | AUC by cached_tokens | B's TTFT p50, right / wrong | "
             "B's cached_tokens p50, right / wrong |", "|---|---:|---:|---:|---:|"]
    for m in MODES:
        r = rows[m]
        right, wrong = (statistics.median(r[k]) * 1000 for k in ("ttft_right", "ttft_wrong"))
        lines.append(f"| {m} | {r['auc_ttft']:.3f} | {r['auc_cached']:.3f} | {right:.0f} / {wrong:.0f} ms"
                     f" | {r['cached_right']:.0f} / {r['cached_wrong']:.0f} |")
    shared, tenant = (", ".join(f"{v:.0f}" for v in rates[m]) for m in MODES)
    lines += ["", f"Throughput with no prompt shared between tenants ({args.rounds} alternating rounds of "
              f"{args.requests} requests, {args.output_len} output tokens, concurrency 8), output tok/s: shared "
              f"{shared}; tenant {tenant}; median ratio tenant / shared **{ratio:.3f}**."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
