"""Serving benchmark: streaming clients over loopback at Poisson request rates (vLLM's benchmark_serving
method), plus the cost of HTTP streaming: output tokens/s through the server vs the offline `engine.LLM`
on the same workload.

    .venv/bin/python benchmarks/served/serving.py --quick             # demo model, a few minutes on a laptop CPU
    .venv/bin/python benchmarks/served/serving.py --model DIR --num-prompts 200 --request-rates 2,4,8,inf

The server runs as a subprocess (`python -m service`), so client and server do not share a GIL. Every
request asks for exactly `--output-len` tokens (ignore_eos, temperature 0); each run gets fresh random
prompts so no run is helped by the prefix cache of an earlier one. Writes benchmarks/results/serving.{md,json}.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
from tqdm import tqdm

from benchmarks.common import scratch_dir, sse_events
from engine.kv import backends as kv_backends

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


@dataclass
class Result:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0


def percentile(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def make_prompts(tokenizer, n: int, input_len: int, seed: int) -> list[list[int]]:
    from tests.helpers.random_checkpoint import demo_corpus
    rng = random.Random(seed)
    lines = demo_corpus(2000, seed=seed)
    prompts = []
    for _ in range(n):
        ids: list[int] = []
        while len(ids) < input_len:
            ids += tokenizer.encode(rng.choice(lines) + " ", add_special_tokens=False)
        prompts.append(ids[:input_len])
    return prompts


async def one_request(session: aiohttp.ClientSession, url: str, prompt: list[int], output_len: int) -> Result:
    body = {"prompt": prompt, "max_tokens": output_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "return_token_ids": True}
    res = Result()
    t0 = last = time.perf_counter()
    try:
        async with session.post(f"{url}/v1/completions", json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return res
            async for chunk in sse_events(resp):
                if "error" in chunk:
                    res.error = chunk["error"]["message"]
                    return res
                n = sum(len(c.get("token_ids", [])) for c in chunk["choices"])
                if not n:
                    continue
                now = time.perf_counter()
                if res.output_tokens == 0:
                    res.ttft = now - t0
                else:
                    res.itl.extend([(now - last) / n] * n)  # a merged delta spreads its gap evenly
                last = now
                res.output_tokens += n
        res.e2e = time.perf_counter() - t0
        res.ok = res.output_tokens == output_len
        if not res.ok:
            res.error = f"got {res.output_tokens} of {output_len} tokens"
    except (TimeoutError, aiohttp.ClientError) as exc:
        res.error = repr(exc)
    return res


async def run_load(url: str, prompts: list[list[int]], output_len: int, rate: float, seed: int,
                   desc: str) -> tuple[list[Result], float]:
    rng = random.Random(seed)
    bar = tqdm(total=len(prompts), desc=desc, leave=False)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def timed(p: list[int]) -> Result:
            r = await one_request(session, url, p, output_len)
            bar.update(1)
            return r

        tasks = []
        t0 = time.perf_counter()
        for p in prompts:
            tasks.append(asyncio.create_task(timed(p)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    bar.close()
    return results, duration


def summarize(rate: float, results: list[Result], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    ms = 1000.0
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    itl = [x for r in ok for x in r.itl]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "request_rate": "inf" if rate == float("inf") else rate, "requests": len(results),
        "errors": len(results) - len(ok),
        "duration_s": duration, "request_throughput": len(ok) / duration, "output_tokens_per_s": out_tokens / duration,
        "ttft_ms_mean": statistics.fmean(r.ttft for r in ok) * ms if ok else float("nan"),
        "ttft_ms_p50": percentile([r.ttft for r in ok], 50) * ms,
        "ttft_ms_p99": percentile([r.ttft for r in ok], 99) * ms,
        "tpot_ms_p50": percentile(tpot, 50) * ms, "tpot_ms_p99": percentile(tpot, 99) * ms,
        "itl_ms_p50": percentile(itl, 50) * ms, "itl_ms_p99": percentile(itl, 99) * ms,
        "first_errors": sorted({r.error for r in results if not r.ok})[:3],
    }


def offline_tokens_per_s(llm, prompts: list[list[int]], output_len: int) -> float:
    from engine import SamplingParams
    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=True)
    duration = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    assert tokens == len(prompts) * output_len
    return tokens / duration


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {"num_kv_blocks": args.num_kv_blocks, "max_num_seqs": args.max_num_seqs, "block_size": args.block_size,
            "kv_backend": args.kv_backend}


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "service", "--port", str(port), "--num-kv-blocks", str(args.num_kv_blocks),
           "--max-num-seqs", str(args.max_num_seqs), "--block-size", str(args.block_size),
           "--max-num-waiting", "100000", "--kv-backend", args.kv_backend]
    if args.model:
        cmd += ["--model", args.model]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("the server never became ready")


def markdown(args: argparse.Namespace, rows: list[dict], overhead: dict) -> str:
    cols = [("request_rate", "rate (req/s)", "{}"), ("requests", "reqs", "{}"), ("errors", "errors", "{}"),
            ("request_throughput", "req/s", "{:.2f}"), ("output_tokens_per_s", "out tok/s", "{:.1f}"),
            ("ttft_ms_p50", "TTFT p50 ms", "{:.1f}"), ("ttft_ms_p99", "TTFT p99 ms", "{:.1f}"),
            ("tpot_ms_p50", "TPOT p50 ms", "{:.2f}"), ("tpot_ms_p99", "TPOT p99 ms", "{:.2f}"),
            ("itl_ms_p50", "ITL p50 ms", "{:.2f}"), ("itl_ms_p99", "ITL p99 ms", "{:.2f}")]
    lines = [f"# Serving benchmark ({'quick, ' if args.quick else ''}{args.model or 'demo model'})", "",
             f"{args.num_prompts} requests per rate, {args.input_len} prompt tokens, {args.output_len} output tokens "
             f"(ignore_eos), temperature 0; max_num_seqs {args.max_num_seqs}, {args.num_kv_blocks} KV blocks of "
             f"{args.block_size}; {os.cpu_count()} CPUs, torch threads {args.torch_threads or 'default'}. "
             "Streaming SSE over loopback; the server is a separate process.", "",
             "| " + " | ".join(c[1] for c in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(fmt.format(r[k]) for k, _, fmt in cols) + " |")
    lines += ["", "## HTTP streaming overhead (all requests at once, best of the rounds)", "",
              "| offline engine.LLM tok/s | server (SSE) tok/s | ratio (target >= 0.9) |", "|---|---|---|",
              f"| {overhead['offline_tokens_per_s']:.1f} | {overhead['server_tokens_per_s']:.1f} | "
              f"{overhead['ratio']:.3f} |", "",
              "Rounds (offline, server tok/s): " + ", ".join(
                  f"({x['offline_tokens_per_s']:.1f}, {x['server_tokens_per_s']:.1f})" for x in overhead["rounds"])
              + f". 1-minute load average at the end: {overhead['loadavg_1m']:.2f} on {os.cpu_count()} CPUs.", ""]
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> None:
    from engine import LLM, SamplingParams
    llm = LLM(args.model, **engine_kwargs(args))
    tok = llm.tokenizer
    rates = [float(x) for x in args.request_rates.split(",")]
    sets = [make_prompts(tok, args.num_prompts, args.input_len, args.seed + i)
            for i in range(len(rates) + 2 * args.overhead_rounds)]
    warmup = make_prompts(tok, 8, args.input_len, args.seed + 1000)
    llm.generate(warmup, SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True))
    proc, url = start_server(args)
    try:
        await run_load(url, warmup, args.output_len, float("inf"), args.seed, "warmup")
        # Overhead: offline and server take turns on same-sized fresh prompt sets (no prefix-cache help),
        # best of the rounds each, so a neighbour's burst of CPU use does not decide the ratio.
        rounds, errors = [], 0
        for r in range(args.overhead_rounds):
            offline = offline_tokens_per_s(llm, sets[2 * r], args.output_len)
            results, dur = await run_load(url, sets[2 * r + 1], args.output_len, float("inf"), args.seed,
                                          f"server, round {r + 1}")
            same = summarize(float("inf"), results, dur)
            errors += same["errors"]
            rounds.append({"offline_tokens_per_s": offline, "server_tokens_per_s": same["output_tokens_per_s"]})
        best_off = max(x["offline_tokens_per_s"] for x in rounds)
        best_srv = max(x["server_tokens_per_s"] for x in rounds)
        overhead = {"offline_tokens_per_s": best_off, "server_tokens_per_s": best_srv, "ratio": best_srv / best_off,
                    "rounds": rounds, "errors": errors, "loadavg_1m": os.getloadavg()[0]}
        rows = []
        for i, rate in enumerate(rates):
            results, dur = await run_load(url, sets[2 * args.overhead_rounds + i], args.output_len, rate,
                                          args.seed + i, f"rate {rate}")
            rows.append(summarize(rate, results, dur))
    finally:
        proc.terminate()
        proc.wait(60)
    report = markdown(args, rows, overhead)
    print(report)
    out = args.out if args.out is not None else scratch_dir("serving")
    out.mkdir(parents=True, exist_ok=True)
    (out / "serving.md").write_text(report)
    (out / "serving.json").write_text(json.dumps({"args": vars(args), "runs": rows, "overhead": overhead}, indent=2))
    if any(r["errors"] for r in rows) or overhead["errors"]:
        raise SystemExit("some requests failed: " + "; ".join(e for r in rows for e in r["first_errors"]))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="checkpoint directory or .gguf file (default: the built-in model)")
    p.add_argument("--num-prompts", type=int, default=200)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--request-rates", default="2,4,8,inf", help="comma-separated; inf = all at once")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--num-kv-blocks", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-backend", default="paged", choices=kv_backends.names())
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overhead-rounds", type=int, default=2, help="offline / server turns for the overhead ratio")
    p.add_argument("--torch-threads", type=int, default=None,
                   help="OMP/torch threads for both the offline engine and the server (default: torch's)")
    p.add_argument("--quick", action="store_true", help="a small run: 32 requests, 64 in / 64 out, rates 2,8,inf")
    p.add_argument("--out", type=Path, default=None, help="where serving.md and .json go (default: a scratch folder)")
    args = p.parse_args()
    if args.torch_threads:  # set before torch loads; the server subprocess inherits it
        os.environ["OMP_NUM_THREADS"] = str(args.torch_threads)
    if args.quick:
        args.num_prompts, args.input_len, args.output_len, args.request_rates = 32, 64, 64, "2,8,inf"
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
