"""The KV tier on disk (issue 37): a restart that restores instead of recomputing, and multi-turn sessions
whose histories outgrow the KV cache.

    prefixserve bench tier [--quick] [--model M] [--lengths 1024,3072] [--sessions S] [--turns T]
        [--vllm-python PATH] [--vllm-dtype float32|bfloat16]

Restart (`prefixserve serve` processes on one redis-server, as a deployment runs them):
  1. server A, with --kv-tier-dir: registers a prefix of each length (pinned: written to the tier), and a
     second text of each length as a 1-second lease (pinned, written, then unpinned when the lease ends:
     its blocks stay on disk only); then stops (SIGTERM).
  2. server B, the same directory: seconds from start to /health 200 (it restores the registered prefixes
     from the tier), then per length the TTFT of the first request naming the prefix, and of the first
     request on the lease's text (not registered any more: loaded from the tier on demand).
  3. server C, no tier: seconds to /health 200 (it recomputes the registered prefixes), then the same two
     requests: the lease's text is a cold compute there.
  Target: cold TTFT / tier TTFT >= 10 (issue's anchors: 13.6x and 17.7x); B ready before C.

Multi-turn (tier_sessions.py): S sessions of T turns, round robin (turn t of every session, then t + 1), each
turn the history so far + U new tokens (token ids), answered with M tokens whose ids are appended to the
history; the KV cache holds a third of the final histories (S x T x (U + M) tokens). The same workload on our
server with the tier, on one without, and on vLLM CPU (--vllm-python, or PREFIXSERVE_PEER_VLLM: the same KV
cache in tokens, prefix caching on, no tier: it recomputes what it evicted): TTFT p50/p90 of turns 2..T, the
prompt tokens served from cache (`cached_tokens`), the tier's hit and miss blocks. Without a vLLM venv the
report says vLLM was not run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

from benchmarks.common import add_common_args, command_line, new_figure, print_result, write_results
from benchmarks.served import tier_sessions
from benchmarks.served.deployment import free_port, post
from benchmarks.served.tier_sessions import WORDS, Server, stream


def text_of(url: str, tokens: int, seed: int) -> tuple[str, int]:
    """Words until the text is `tokens` tokens long (or one word short of it): the text and its count."""
    rng = random.Random(seed)
    words = [f"{seed}:"] + [rng.choice(WORDS) for _ in range(tokens)]
    lo, hi = 1, len(words)
    while lo < hi:                       # the longest prefix of the words within `tokens`
        mid = (lo + hi + 1) // 2
        if post(f"{url}/tokenize", {"prompt": " ".join(words[:mid])})["count"] <= tokens:
            lo = mid
        else:
            hi = mid - 1
    text = " ".join(words[:lo])
    return text, int(post(f"{url}/tokenize", {"prompt": text})["count"])


def first_requests(srv: Server, texts: dict[int, str]) -> dict[str, dict[int, float]]:
    """TTFT of the first request naming each registered prefix, and of the first on each lease text."""
    async def go() -> dict[str, dict[int, float]]:
        out: dict[str, dict[int, float]] = {"named": {}, "lease": {}}
        async with aiohttp.ClientSession() as s:
            for n in texts:
                out["named"][n] = (await stream(s, srv.url, {"prefix": f"p{n}", "prompt": " Question: why?",
                                                             "max_tokens": 1}))["ttft"]
                out["lease"][n] = (await stream(s, srv.url, {"prompt": texts[n] + " Question: why?",
                                                             "max_tokens": 1}))["ttft"]
        return out
    return asyncio.run(go())


def restart(args: argparse.Namespace, tmp: Path, redis_url: str) -> dict[str, Any]:
    tier = ["--kv-tier-dir", str(tmp / "tier")]
    base = ["--redis-url", redis_url, "--num-kv-blocks", str(args.restart_blocks)]
    a = Server(args, tmp / "a.log", base + tier)
    try:
        named, leased, counts = {}, {}, {}
        for n in args.lengths:
            named[n], counts[n] = text_of(a.url, n, seed=n)
            leased[n], _ = text_of(a.url, n, seed=n + 1)
            post(f"{a.url}/v1/prefixes", {"name": f"p{n}", "prompt": named[n]})
            post(f"{a.url}/v1/prefixes", {"name": f"lease{n}", "prompt": leased[n], "ttl_seconds": 1})
        deadline = time.monotonic() + 60                      # the leases end (the sweep runs every second)
        while any(e["name"].startswith("lease") for e in json.loads(
                urllib.request.urlopen(f"{a.url}/v1/prefixes", timeout=10).read())["data"]):
            assert time.monotonic() < deadline, "the leases never ended"
            time.sleep(0.5)
    finally:
        a.stop()
    b = Server(args, tmp / "b.log", base + tier)
    try:
        tier_ttft = first_requests(b, leased)
        tier_stats = {k: b.metric(f"prefixserve_kv_tier_{k}_total") for k in ("hit_blocks", "loads")}
        tier_stats["load_seconds"] = b.metric("prefixserve_kv_tier_load_seconds_total")
        tier_ready = b.ready_s
    finally:
        b.stop()
    c = Server(args, tmp / "c.log", base)
    try:
        cold_ttft = first_requests(c, leased)
        cold_ready = c.ready_s
    finally:
        c.stop()
    return {"tokens": counts, "ready_s": {"tier": tier_ready, "recompute": cold_ready},
            "ttft": {"tier": tier_ttft, "no_tier": cold_ttft}, "tier_stats": tier_stats}


def main(argv: list[str] | None = None, prog: str = "python -m benchmarks.served.tier") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(ap)
    ap.add_argument("--lengths", default="1024,3072", help="registered prefix lengths in tokens, comma-separated")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--restart-blocks", type=int, default=2048, help="KV blocks of the restart servers")
    ap.add_argument("--sessions", type=int, default=None, help="multi-turn sessions (default 12, --quick 4)")
    ap.add_argument("--turns", type=int, default=None, help="turns per session (default 6, --quick 3)")
    ap.add_argument("--user-tokens", type=int, default=None, help="tokens a user adds per turn (default 224, "
                    "--quick 160)")
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--session-blocks", type=int, default=None,
                    help="our KV blocks (16 tokens) on the multi-turn servers (default: a third of the final "
                         "histories, at least one session's, in multiples of 32 tokens); vLLM gets as many tokens")
    ap.add_argument("--vllm-python", default=None,
                    help="the vLLM CPU venv's python (or PREFIXSERVE_PEER_VLLM): the sessions on vLLM too")
    ap.add_argument("--vllm-dtype", default="float32", choices=["float32", "bfloat16"],
                    help="vLLM's --dtype (default float32: on AVX2-only CPUs vLLM's bfloat16 is emulated, slower)")
    ap.add_argument("--skip", default="", help="restart or sessions: a part not to run")
    args = ap.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    for name, full, quick in (("sessions", 12, 4), ("turns", 6, 3), ("user_tokens", 224, 160)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    try:                                        # before the restart part spends minutes
        tier_sessions.sizes(args.sessions, args.turns, args.user_tokens, args.answer_tokens, args.session_blocks)
    except ValueError as exc:
        ap.error(str(exc))
    redis = shutil.which("redis-server")
    if redis is None:
        raise SystemExit("redis-server not found on PATH (the registry outlives a restart in Redis)")
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="bench-tier-") as tmp_name:
        tmp = Path(tmp_name)
        port = free_port()
        rproc = subprocess.Popen([redis, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly",
                                  "no", "--dir", tmp_name], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        try:
            time.sleep(0.5)
            parts = [p for p in ("restart", "sessions") if p not in args.skip.split(",")]
            for part in tqdm(parts, desc="tier"):
                if part == "restart":
                    out["restart"] = restart(args, tmp, f"redis://127.0.0.1:{port}/0")
                else:
                    out["sessions"] = tier_sessions.run(args, tmp)
                tqdm.write(report(args, {part: out[part]})[0])      # each part's table as soon as it is done
        finally:
            rproc.terminate()
            rproc.wait(10)
    table, result = report(args, out)
    print(table)
    fig = figure(args, out)
    write_results("tier", table, {**result, "raw": out}, args.out, fig, command_line(prog, argv))
    print_result(result)
    return 0


def report(args: argparse.Namespace, out: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    lines: list[str] = []
    result: dict[str, Any] = {}
    if "restart" in out:
        r = out["restart"]
        lines += ["### Restart", "", "| prefix tokens | first request on the registered prefix after a restart, "
                  "TTFT | first request on a text only the tier holds, TTFT | same text, no tier (cold compute) | "
                  "cold / tier |", "|---:|---:|---:|---:|---:|"]
        for n in args.lengths:
            tier, cold = r["ttft"]["tier"]["lease"][n], r["ttft"]["no_tier"]["lease"][n]
            lines.append(f"| {r['tokens'][n]} | {r['ttft']['tier']['named'][n] * 1000:.0f} ms | {tier * 1000:.0f} ms "
                         f"| {cold * 1000:.0f} ms | **{cold / tier:.1f}x** |")
            result[f"cold_over_tier_{n}"] = round(cold / tier, 2)
        ready = r["ready_s"]
        lines += ["", f"Start to /health 200 with {len(args.lengths)} registered prefixes "
                  f"({sum(r['tokens'].values())} tokens): restored from the tier **{ready['tier']:.1f} s**, "
                  f"recomputed {ready['recompute']:.1f} s (both include loading the model). Tier after the "
                  f"restart: {r['tier_stats']['hit_blocks']:.0f} blocks loaded in {r['tier_stats']['loads']:.0f} "
                  f"loads, {r['tier_stats']['load_seconds']:.2f} s in all.", ""]
        result |= {"ready_s_tier": round(ready["tier"], 2), "ready_s_recompute": round(ready["recompute"], 2)}
    if "sessions" in out:
        more, figures = tier_sessions.report(args, out["sessions"])
        lines += more
        result |= figures
    return "\n".join(lines) + "\n", result


def figure(args: argparse.Namespace, out: dict[str, Any]) -> Any:
    parts = [p for p in ("restart", "sessions") if p in out]
    fig, axes = new_figure(max(1, len(parts)), width=5.5)
    for ax, part in zip(axes, parts):
        if part == "restart":
            r = out["restart"]
            x = range(len(args.lengths))
            ax.bar([i - 0.2 for i in x], [r["ttft"]["tier"]["lease"][n] * 1000 for n in args.lengths], 0.4,
                   label="from the tier")
            ax.bar([i + 0.2 for i in x], [r["ttft"]["no_tier"]["lease"][n] * 1000 for n in args.lengths], 0.4,
                   label="cold compute")
            ax.set_yscale("log")
            ax.set_xticks(list(x), [f"{n} tokens" for n in args.lengths])
            ax.set_ylabel("first-request TTFT after a restart (ms, log)")
        else:
            tier_sessions.plot(ax, args, out["sessions"])
        ax.legend(fontsize=8)
    return fig


if __name__ == "__main__":
    raise SystemExit(main())
