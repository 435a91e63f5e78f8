"""The multi-turn part of `prefixserve bench tier`, and the two pieces both of its parts use: our server
process (`Server`) and one streamed completion (`stream`).

Workload: S sessions of T turns, round robin (turn t of every session, then t + 1); each turn sends the
session's history so far + U new user tokens (token ids: words of a fixed list drawn by a generator seeded
with --seed, so every system gets the same ones), asks for M tokens (greedy, `ignore_eos`: exactly M, checked)
and appends the M answer ids it got back (`return_token_ids`, streamed by both servers) to the history.
TTFT (streamed: the first chunk with a choice) and `usage.prompt_tokens_details.cached_tokens` of turns 2..T.

Systems, one after the other: ours with the tier (`--kv-tier-dir`), ours without, and vLLM CPU
(`--vllm-python`), which has no tier: a block its cache evicted is recomputed.

What makes the three comparable:
- **The same growth.** Every history grows by the same user ids and by M answer ids; the answer ids are each
  system's own, as a client would send its conversation back. So each system's prefix cache keeps the blocks
  its decode filled, as it would for a real client; the histories differ only in the answers' content (vLLM
  runs the float32 checkpoint, ours its own weights: int4 for the built-in model), never in their lengths, and
  the compute depends on lengths, not content.
- **The same KV cache in tokens.** Ours: `--num-kv-blocks` blocks of 16 tokens. vLLM's CPU attention takes
  only block sizes that are multiples of 32 (vLLM 0.32: CPU_ATTN's kernel block sizes are `MultipleOf(32)`),
  so it gets `--block-size 32` and `--num-gpu-blocks-override` = our tokens / 32 + 1 (its block pool holds one
  null block back). Our cache defaults to a multiple of 32 tokens, so both hold exactly as many.
- **The same length limit.** `--max-model-len` = the longest history (T x (U + M)) on all three. vLLM refuses
  a length its cache cannot hold, so the cache holds at least that: a third of the final histories by default,
  more with fewer than 3 sessions (the report gives the ratio).
- **The same threads.** Ours `--torch-threads` = --threads; vLLM's OpenMP threads bound to that many of the
  cores this process may use (all when --threads 0).
- **Not the same**: vLLM's prefix cache matches whole 32-token blocks, ours 16-token blocks (a history's last
  partial block is recomputed on both: up to 31 tokens there, 15 here).
"""
from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import aiohttp

from benchmarks.common import sse_events
from benchmarks.served.deployment import ROOT, free_port, metric, post, stop_process, wait_ready
from benchmarks.served.peers.client import pct
from benchmarks.served.peers.servers import peer_python, vllm_server

WORDS = ("cache block token prefix restart disk replica tenant kernel attention query value batch page hash "
         "chain verify memory latency schedule prompt answer server request stream model layer head").split()
BLOCK = 16               # our KV block, tokens
VLLM_BLOCK = 32          # the smallest block vLLM's CPU attention takes


class Server:
    """One `prefixserve serve` process; `ready_s`: seconds from its start to /health 200."""

    def __init__(self, args: argparse.Namespace, log: Path, extra: list[str], max_model_len: int | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "service", "serve", "--host", "127.0.0.1", "--port", str(self.port),
               "--served-model-name", "m", "--log-level", "warning",
               "--max-model-len", str(max_model_len or args.max_model_len), "--kv-backend", args.kv_backend, *extra]
        if args.model:
            cmd += ["--model", args.model]
        if args.quantization:
            cmd += ["--quantization", args.quantization]
        if args.threads > 0:
            cmd += ["--torch-threads", str(args.threads)]
        start = time.perf_counter()
        with open(log, "wb") as out:
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        wait_ready(f"{self.url}/health", self.proc, f"server ({log.name})")
        self.ready_s = time.perf_counter() - start

    def metric(self, name: str) -> float:
        return metric(self.url, name)

    def stop(self) -> None:
        stop_process(self.proc)


async def stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One streamed completion: TTFT (s), cached and prompt tokens, the output's token ids."""
    body = {"model": "m", "temperature": 0, "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}, **body}
    start = time.perf_counter()
    ttft: float | None = None
    ids: list[int] = []
    usage: dict[str, Any] = {}
    async with session.post(f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        async for chunk in sse_events(r):
            for c in chunk.get("choices") or []:
                ttft = ttft if ttft is not None else time.perf_counter() - start
                ids += c.get("token_ids") or []
            usage = chunk.get("usage") or usage
    return {"ttft": ttft or 0.0, "cached": usage["prompt_tokens_details"]["cached_tokens"],
            "prompt": usage["prompt_tokens"], "ids": ids}


@dataclass(frozen=True)
class Sizes:
    """The KV cache and length limit every system gets for a workload."""
    total: int             # the final histories of all sessions, tokens
    longest: int           # one session's final history: every server's --max-model-len
    blocks: int            # our --num-kv-blocks (of BLOCK tokens)
    vllm_blocks: int       # vLLM's --num-gpu-blocks-override (of VLLM_BLOCK tokens, its null block included)

    @property
    def tokens(self) -> int:
        return self.blocks * BLOCK

    @property
    def vllm_tokens(self) -> int:
        return (self.vllm_blocks - 1) * VLLM_BLOCK


def sizes(sessions: int, turns: int, user: int, answer: int, blocks: int | None = None) -> Sizes:
    """Our cache `blocks` (default: a third of the final histories, at least the longest, in whole vLLM
    blocks) and vLLM's as many tokens in its blocks; ValueError if `blocks` cannot hold one history."""
    total, longest = sessions * turns * (user + answer), turns * (user + answer)
    if blocks is None:
        blocks = -(-max(total // 3, longest) // VLLM_BLOCK) * VLLM_BLOCK // BLOCK
    elif blocks * BLOCK < longest:
        raise ValueError(f"--session-blocks {blocks} holds {blocks * BLOCK} tokens, fewer than one session's final "
                         f"history ({longest}): no server could take its last turn")
    return Sizes(total, longest, blocks, -(-blocks * BLOCK // VLLM_BLOCK) + 1)


async def converse(url: str, words: list[int], args: argparse.Namespace) -> list[dict[str, Any]]:
    """The whole workload on one server: a row per turn (turn, session, ttft, cached, prompt)."""
    rng = random.Random(args.seed)
    histories: list[list[int]] = [[] for _ in range(args.sessions)]
    rows = []
    async with aiohttp.ClientSession() as session:
        for turn in range(args.turns):
            for s in range(args.sessions):
                histories[s] += rng.choices(words, k=args.user_tokens)
                r = await stream(session, url, {"prompt": histories[s], "max_tokens": args.answer_tokens})
                if len(r["ids"]) != args.answer_tokens:
                    raise RuntimeError(f"{url}: {len(r['ids'])} answer ids, not {args.answer_tokens}")
                histories[s] += r["ids"]
                rows.append({"turn": turn, "session": s, **{k: r[k] for k in ("ttft", "cached", "prompt")}})
    return rows


def summary(rows: list[dict[str, Any]], args: argparse.Namespace) -> dict[str, Any]:
    later = [r for r in rows if r["turn"] > 0]
    ttfts = [r["ttft"] for r in later]          # percentiles interpolated, as bench peers reports them
    return {"rows": rows, "ttft_p50": pct(ttfts, 50), "ttft_p90": pct(ttfts, 90),
            "cached_share": sum(r["cached"] for r in later) / sum(r["prompt"] for r in later),
            "final_history_tokens": sum(r["prompt"] for r in rows if r["turn"] == args.turns - 1)}


def ours(args: argparse.Namespace, tmp: Path, size: Sizes, with_tier: bool) -> dict[str, Any]:
    extra = ["--num-kv-blocks", str(size.blocks), "--max-num-seqs", "8"]
    if with_tier:
        extra += ["--kv-tier-dir", str(tmp / "sessions-tier")]
    srv = Server(args, tmp / f"sessions-{with_tier}.log", extra, max_model_len=size.longest)
    try:
        words = post(f"{srv.url}/tokenize", {"prompt": " ".join(WORDS), "add_special_tokens": False})["tokens"]
        rows = asyncio.run(converse(srv.url, words, args))
        stats = {k: srv.metric(f"prefixserve_kv_tier_{k}_total") for k in ("hit_blocks", "miss_blocks")}
    finally:
        srv.stop()
    return {**summary(rows, args), **stats, "words": words}


def vllm_flags(size: Sizes) -> tuple[str, ...]:
    """vLLM's cache as many tokens as ours, `cached_tokens` in its usage, our --max-num-seqs."""
    return ("--block-size", str(VLLM_BLOCK), "--num-gpu-blocks-override", str(size.vllm_blocks),
            "--max-num-seqs", "8", "--enable-prompt-tokens-details")


def vllm(args: argparse.Namespace, tmp: Path, size: Sizes, words: list[int], python: str) -> dict[str, Any]:
    """The workload on vLLM CPU, on the float32 checkpoint our loader caches for the model."""
    from benchmarks.served.peers.bench import served_model
    from engine.models.default import default_model_path
    from engine.models.loader import resolve_model_path

    gguf = args.model or str(default_model_path())
    checkpoint = str(resolve_model_path(gguf))
    server = vllm_server(python, checkpoint, args.vllm_dtype, size.longest, args.threads, vllm_flags(size))
    try:
        start_s = server.start(tmp)
    except RuntimeError as exc:                  # its log goes with the temporary folder: keep its end
        tail = server.log.read_text(errors="replace")[-2000:] if server.log and server.log.exists() else ""
        raise RuntimeError(f"{exc}\n{tail}") from exc
    try:
        rows = asyncio.run(converse(server.url, words, args))
    finally:
        server.stop()
    return {**summary(rows, args), "start_s": start_s, "version": server.version,
            "model": served_model("vllm", gguf, checkpoint, args.vllm_dtype), "ours_model": Path(gguf).name}


def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Ours with the tier, ours without, then vLLM CPU if --vllm-python (or PREFIXSERVE_PEER_VLLM) names it."""
    size = sizes(args.sessions, args.turns, args.user_tokens, args.answer_tokens, args.session_blocks)
    out: dict[str, Any] = {"sizes": asdict(size), "tier": ours(args, tmp, size, True),
                           "no_tier": ours(args, tmp, size, False)}
    python, why = peer_python(args.vllm_python, "PREFIXSERVE_PEER_VLLM")
    if python is None:
        out["vllm_absent"] = why
        return out
    try:
        out["vllm"] = vllm(args, tmp, size, out["tier"]["words"], python)
    except (RuntimeError, OSError, KeyError, aiohttp.ClientError) as exc:    # reported, never replaced by another
        print(f"vllm: {exc}", file=sys.stderr)                                 # system's figure
        out["vllm_absent"] = f"failed: {(str(exc) or repr(exc)).splitlines()[0][:300]}"
    return out


ROWS = (("tier", "ours, with the tier"), ("no_tier", "ours, without the tier"), ("vllm", "vLLM CPU (recomputes)"))


def report(args: argparse.Namespace, s: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """The section's markdown lines and its figures for RESULT."""
    size = Sizes(**s["sizes"])
    lines = ["### Multi-turn sessions", "",
             f"{args.sessions} sessions x {args.turns} turns, round robin, {args.user_tokens} new tokens and a "
             f"{args.answer_tokens}-token answer per turn; final histories {size.total:,} tokens in all, "
             f"**{size.total / size.tokens:.1f}x** the KV cache of {size.tokens:,} tokens (ours: {size.blocks} "
             f"blocks of {BLOCK}" + (f"; vLLM: {size.vllm_blocks} blocks of {VLLM_BLOCK}, one held back by vLLM, "
                                     f"{size.vllm_tokens:,} tokens" if "vllm" in s else "") +
             f"); --max-model-len {size.longest:,} (the longest history) on every server; turns 2..{args.turns}:", "",
             "| | TTFT p50 | TTFT p90 | prompt tokens from cache | tier hit blocks | tier miss blocks |",
             "|---|---:|---:|---:|---:|---:|"]
    result: dict[str, Any] = {}
    for name, label in ROWS:
        if name not in s:
            continue
        v = s[name]
        tier = (f"{v['hit_blocks']:.0f} | {v['miss_blocks']:.0f}" if name != "vllm" else "- | -")
        lines.append(f"| {label} | {v['ttft_p50'] * 1000:.0f} ms | {v['ttft_p90'] * 1000:.0f} ms | "
                     f"{v['cached_share']:.1%} | {tier} |")
        result |= {f"sessions_{name}_ttft_p50_ms": round(v["ttft_p50"] * 1000, 1),
                   f"sessions_{name}_ttft_p90_ms": round(v["ttft_p90"] * 1000, 1),
                   f"sessions_{name}_cached_share": round(v["cached_share"], 3)}
    lines.append("")
    if "vllm" in s:
        v, t = s["vllm"], s["tier"]
        p50, p90 = v["ttft_p50"] / t["ttft_p50"], v["ttft_p90"] / t["ttft_p90"]
        lines += [f"Ours with the tier against vLLM CPU: TTFT p50 **{p50:.2f}x**, p90 **{p90:.2f}x** (vLLM's / ours: "
                  f"> 1, ours is faster). Models: ours {v['ours_model']}"
                  f"{f' ({args.quantization})' if args.quantization else ''}, vLLM {v['version']} {v['model']} "
                  f"(started in {v['start_s']:.0f} s); {args.threads or 'all'} thread(s) each.", ""]
        result |= {"sessions_vllm_over_tier_ttft_p50": round(p50, 2), "sessions_vllm_over_tier_ttft_p90": round(p90, 2)}
    else:
        lines += [f"vLLM CPU: not run ({s.get('vllm_absent', 'not configured')}).", ""]
        result["sessions_vllm_absent"] = s.get("vllm_absent", "not configured")
    return lines, result


def plot(ax: Any, args: argparse.Namespace, s: dict[str, Any]) -> None:
    """TTFT p50 per turn, one line per system."""
    for name, label in ROWS:
        if name not in s:
            continue
        rows = s[name]["rows"]
        turns = sorted({r["turn"] for r in rows})
        ax.plot([t + 1 for t in turns], [statistics.median(r["ttft"] * 1000 for r in rows if r["turn"] == t)
                                         for t in turns], marker="o", label=label)
    ax.set_xticks(range(1, args.turns + 1))
    ax.set_xlabel("turn")
    ax.set_ylabel("TTFT p50 (ms)")
