"""The one client of `bench peers`: streamed OpenAI requests timed at the first text chunk, the same for every
server (aiohttp; each server is told to generate exactly max_tokens its own way: `Server.sampling`)."""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import aiohttp
from tqdm import tqdm

from benchmarks.common import sse_events
from benchmarks.served.peers.servers import MODEL, Server


@dataclass
class Timing:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    tokens: int = 0
    text: str = ""                          # the generated text (a chat session sends it back)
    prompt_tokens: int | None = None        # from the final usage, where the server sends one


def sampling_fields(server: Server, max_tokens: int) -> dict[str, Any]:
    return {k: (max_tokens if v == "{max_tokens}" else v) for k, v in server.sampling.items()}


def client_session() -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), timeout=aiohttp.ClientTimeout(total=3600))


async def request(session: aiohttp.ClientSession, server: Server, path: str, body: dict[str, Any]) -> Timing:
    """One streamed request; TTFT at the first chunk that carries text, tokens from the final usage (or, if a
    server sends none, one per text chunk)."""
    body = {**body, "model": MODEL, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0,
            **sampling_fields(server, body["max_tokens"])}
    res = Timing()
    chunks = 0
    pieces: list[str] = []
    usage_tokens = None
    t0 = time.perf_counter()
    try:
        async with session.post(server.url + path, json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            async for chunk in sse_events(resp):
                if "error" in chunk:
                    res.error = str(chunk["error"])[:300]
                    return res
                if chunk.get("usage"):
                    usage_tokens = chunk["usage"].get("completion_tokens")
                    res.prompt_tokens = chunk["usage"].get("prompt_tokens")
                for c in chunk.get("choices") or []:
                    text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                    if text:
                        chunks += 1
                        pieces.append(text)
                        if not res.ttft:
                            res.ttft = time.perf_counter() - t0
        res.e2e = time.perf_counter() - t0
        res.text = "".join(pieces)
        res.tokens = usage_tokens if usage_tokens is not None else chunks
        res.ok = res.tokens == body["max_tokens"]
        if not res.ok:
            res.error = f"got {res.tokens} of {body['max_tokens']} tokens"
    except (TimeoutError, aiohttp.ClientError) as exc:
        res.error = repr(exc)
    return res


def check(server: Server, desc: str, out: list[Timing]) -> None:
    failed = [r.error for r in out if not r.ok]
    if failed:
        raise RuntimeError(f"{server.name}, {desc}: {len(failed)} of {len(out)} requests failed: {failed[0]}")


async def run_requests(server: Server, items: list[tuple[str, dict[str, Any]]], concurrency: int,
                       desc: str) -> tuple[list[Timing], float]:
    """All items through at most `concurrency` at a time; (timings in item order, wall seconds)."""
    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(items), desc=desc, leave=False)
    async with client_session() as session:
        async def one(path: str, body: dict[str, Any]) -> Timing:
            async with sem:
                r = await request(session, server, path, body)
            bar.update(1)
            return r

        t = time.perf_counter()
        out = await asyncio.gather(*(one(p, b) for p, b in items))
        wall = time.perf_counter() - t
    bar.close()
    check(server, desc, list(out))
    return list(out), wall


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
