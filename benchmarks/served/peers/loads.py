"""The workloads of `bench peers` driven by our own client (benchmarks/served/peers/client.py). Each returns
its figures (keys of `report.FIGURES`, plus a few recorded only in the JSON).

    throughput    64 prompts x 128 tokens in / 128 out, sent at once: output tokens / wall time
    single        one 128-token prompt at a time (3 requests): TTFT, and decode tok/s after the first token
    shared        a 1,024-token system prompt + a 32-token question, 64 out, 32 requests at concurrency 8:
                  TTFT p50 / p90 and output tok/s; `shared_named`: the same with the system prompt
                  registered first as a named prefix (prefixserve only)
    long3k/long8k a 3,072- / 8,192-token system prompt (cut to fit the model's context: prompts.py) + distinct
                  64-token questions, 64 out, 48 requests at concurrency 16: TTFT p50 / p90, output tok/s
    many_systems  16 distinct 512-token system prompts x 4 users (64-token questions, shuffled arrivals),
                  64 out, concurrency 8: TTFT p50 / p90, output tok/s
    sessions      8 chat sessions at once, 6 turns each (256-token system prompt, 64-token user turns,
                  64 out), every turn resending the whole history with the answers the server gave:
                  total time, TTFT p50 / p90
"""
from __future__ import annotations

import asyncio
import json
import statistics
import time
import urllib.request
from typing import Any

from tqdm import tqdm

from benchmarks.served.peers.client import Timing, check, client_session, pct, request, run_requests
from benchmarks.served.peers.prompts import (
    LONG_CONCURRENCY,
    LONG_OUT,
    MANY_CONCURRENCY,
    MANY_OUT,
    SESSION_OUT,
    SHARED_CONCURRENCY,
    SHARED_OUT,
    SINGLE_OUT,
    THROUGHPUT_OUT,
    Session,
    SharedPrompt,
    Workload,
)
from benchmarks.served.peers.servers import Server


def latency_figures(key: str, res: list[Timing], wall: float) -> dict[str, float]:
    ttfts = [1000 * r.ttft for r in res]
    return {f"{key}_ttft_p50_ms": pct(ttfts, 50), f"{key}_ttft_p90_ms": pct(ttfts, 90),
            f"{key}_tok_s": sum(r.tokens for r in res) / wall}


def run_throughput(server: Server, w: Workload) -> dict[str, float]:
    items = [("/v1/completions", {"prompt": p, "max_tokens": THROUGHPUT_OUT}) for p in w.throughput]
    res, wall = asyncio.run(run_requests(server, items, len(items), "throughput"))
    return {"throughput_tok_s": sum(r.tokens for r in res) / wall}


def run_single(server: Server, w: Workload) -> dict[str, float]:
    items = [("/v1/completions", {"prompt": p, "max_tokens": SINGLE_OUT}) for p in w.single]
    res, _ = asyncio.run(run_requests(server, items, 1, "single"))
    return {"single_ttft_ms": 1000 * statistics.median(r.ttft for r in res),
            "single_decode_tok_s": statistics.median((r.tokens - 1) / (r.e2e - r.ttft) for r in res)}


def run_shared(server: Server, p: SharedPrompt, key: str, concurrency: int = SHARED_CONCURRENCY,
               max_tokens: int = SHARED_OUT, named: str | None = None) -> dict[str, float]:
    """Every question after the same system prompt (or, `named`, after the prefix registered under that name)."""
    def body(q: str) -> dict[str, Any]:
        if named is not None:
            return {"prefix": named, "messages": [{"role": "user", "content": q}], "max_tokens": max_tokens}
        return {"messages": [{"role": "system", "content": p.system}, {"role": "user", "content": q}],
                "max_tokens": max_tokens}

    items = [("/v1/chat/completions", body(q)) for q in p.questions]
    res, wall = asyncio.run(run_requests(server, items, concurrency, key))
    return latency_figures(key, res, wall)


def run_long(server: Server, w: Workload, key: str) -> dict[str, float]:
    return run_shared(server, w.long[key], key, LONG_CONCURRENCY, LONG_OUT)


def register(server: Server, name: str, system: str) -> None:
    body = json.dumps({"name": name, "messages": [{"role": "system", "content": system}]}).encode()
    req = urllib.request.Request(server.url + "/v1/prefixes", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        assert resp.status in (200, 201), resp.status


def run_named(server: Server, w: Workload, name: str) -> dict[str, float]:
    register(server, name, w.shared.system)
    return run_shared(server, w.shared, "shared_named", named=name)


def run_many(server: Server, w: Workload) -> dict[str, float]:
    items = [("/v1/chat/completions", {"messages": [{"role": "system", "content": s}, {"role": "user", "content": q}],
                                       "max_tokens": MANY_OUT}) for s, q in w.many]
    res, wall = asyncio.run(run_requests(server, items, MANY_CONCURRENCY, "many_systems"))
    return latency_figures("many", res, wall)


async def sessions(server: Server, chats: list[Session], max_tokens: int) -> tuple[list[list[Timing]], float]:
    """Every session at once, each turn after the previous answer: the history (system prompt, user turns
    and the server's own answers) resent whole every turn. (timings per session and turn, wall seconds)"""
    bar = tqdm(total=sum(len(c.turns) for c in chats), desc="sessions", leave=False)
    async with client_session() as http:
        async def one(chat: Session) -> list[Timing]:
            history = [{"role": "system", "content": chat.system}]
            out: list[Timing] = []
            for turn in chat.turns:
                history.append({"role": "user", "content": turn})
                r = await request(http, server, "/v1/chat/completions",
                                  {"messages": list(history), "max_tokens": max_tokens})
                out.append(r)
                bar.update(1)
                if not r.ok:
                    break
                history.append({"role": "assistant", "content": r.text})
            return out

        t = time.perf_counter()
        res = await asyncio.gather(*(one(c) for c in chats))
        wall = time.perf_counter() - t
    bar.close()
    return list(res), wall


def run_sessions(server: Server, w: Workload) -> dict[str, float]:
    per_session, wall = asyncio.run(sessions(server, w.sessions, SESSION_OUT))
    return session_figures(server, per_session, wall)


def session_figures(server: Server, per_session: list[list[Timing]], wall: float) -> dict[str, float]:
    flat = [r for s in per_session for r in s]
    check(server, "sessions", flat)
    ttfts = [1000 * r.ttft for r in flat]
    return {"sessions_total_s": wall, "sessions_ttft_p50_ms": pct(ttfts, 50), "sessions_ttft_p90_ms": pct(ttfts, 90),
            "sessions_prompt_tokens": float(sum(r.prompt_tokens or 0 for r in flat))}
