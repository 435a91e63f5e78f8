"""prefixserve beside its peers on this machine: the same weights, prompts, client and output lengths.

    prefixserve bench peers [--rounds 2] [--systems prefixserve vllm llama.cpp] [--out DIR]
        [--vllm-python PATH] [--llama-cpp-python PATH]       (or PREFIXSERVE_PEER_VLLM / _LLAMA_CPP)

Each system's OpenAI server is started on loopback, one at a time, and driven by this process:

    prefixserve   `python -m service serve` (this checkout), the built-in model as it serves by default
    vLLM CPU      `<vllm venv>/bin/python -m vllm.entrypoints.openai.api_server` on the float32 checkpoint
                  our GGUF loader caches, --dtype bfloat16, --enable-prefix-caching, its OpenMP threads
                  bound to the cores this process may use (VLLM_CPU_OMP_THREADS_BIND), 4 GiB of KV cache
    llama.cpp     `<llama venv>/bin/python -m llama_cpp.server` on the GGUF itself (its own 4-bit kernels);
                  one request at a time (its server queues them: --interrupt_requests False)

Workloads (greedy; every request generates exactly its max_tokens: `ignore_eos` where the server has it,
`min_tokens` where it does not):

    throughput    64 prompts x 128 tokens in / 128 out, sent at once: output tokens / wall time
    single        one 128-token prompt at a time (3 requests): TTFT, and decode tok/s after the first token
    shared        a 1,024-token system prompt + a 32-token question, 64 out, 32 requests at concurrency 8:
                  TTFT p50 / p90 and output tok/s; `shared_named`: the same with the system prompt
                  registered first as a named prefix (prefixserve only)
    guidellm      another load generator none of us wrote, streaming: guidellm (its own venv: --guidellm,
                  or PREFIXSERVE_GUIDELLM), 4 concurrent streams, 24 synthetic requests of 128 in / 32 out:
                  requests completed (all must), TTFT p50 and output tok/s
    loadgen       a load generator none of us wrote: `vllm bench serve` (from the vLLM venv), random
                  128 in / 64 out, Poisson 2 req/s, 60 requests: req/s, TTFT p50, TPOT p50

Systems alternate within each round (the order reversed every other round) and every figure is the median
over rounds; the 1-minute load average is recorded before each workload. A peer that is not installed or
does not start is reported absent, with the reason: never replaced by a figure recorded elsewhere.
Writes peers.md, peers.json and peers.png (ours vs each peer, per figure) into --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
from tqdm import tqdm

from benchmarks.common import command_line, new_figure, print_result, write_results

ROOT = Path(__file__).resolve().parents[2]
SYSTEMS = ("prefixserve", "vllm", "llama.cpp")
MODEL = "m"                     # the served model name every server is given
WORDS = ("river mountain garden window lantern harbor meadow castle forest silver copper engine signal "
         "market bridge canyon desert island valley winter summer autumn spring letter number puzzle "
         "theory method system network pattern history science music painting language travel").split()

# What "higher is better" means for each figure, and how it reads in the table.
FIGURES: dict[str, tuple[str, bool, str]] = {
    # key: (label, higher_is_better, unit)
    "throughput_tok_s": ("offline throughput: 64 x 128 in / 128 out, at once", True, "tok/s"),
    "single_ttft_ms": ("one stream, 128-token prompt: TTFT", False, "ms"),
    "single_decode_tok_s": ("one stream: decode", True, "tok/s"),
    "shared_ttft_p50_ms": ("shared 1,024-token prefix + 32, 64 out, 32 req, conc. 8: TTFT p50", False, "ms"),
    "shared_ttft_p90_ms": ("same: TTFT p90", False, "ms"),
    "shared_tok_s": ("same: output tok/s", True, "tok/s"),
    "shared_named_ttft_p50_ms": ("same, prefix registered by name: TTFT p50", False, "ms"),
    "shared_named_ttft_p90_ms": ("same, registered: TTFT p90", False, "ms"),
    "shared_named_tok_s": ("same, registered: output tok/s", True, "tok/s"),
    "guidellm_ttft_p50_ms": ("guidellm, 4 streams, 128 in / 32 out: TTFT p50", False, "ms"),
    "guidellm_tok_s": ("same: output tok/s", True, "tok/s"),
    "loadgen_req_s": ("`vllm bench serve`, random 128 in / 64 out, 2 req/s: req/s", True, "req/s"),
    "loadgen_ttft_p50_ms": ("same: TTFT p50", False, "ms"),
    "loadgen_tpot_p50_ms": ("same: TPOT p50", False, "ms"),
}


# -- servers ----------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cores() -> list[int]:
    return sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))


@dataclass
class Server:
    name: str
    argv: list[str]
    env: dict[str, str]
    port: int
    start_timeout: float
    sampling: dict[str, Any]                 # how this server is told to generate exactly max_tokens
    version: str = ""
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, log_dir: Path) -> float:
        """Starts the server; the seconds until it answered /v1/models. Raises RuntimeError if it never does."""
        self.log = log_dir / f"{self.name}-{self.port}.log"
        out = self.log.open("wb")
        t = time.perf_counter()
        self.proc = subprocess.Popen(self.argv, env={**os.environ, **self.env}, stdout=out, stderr=subprocess.STDOUT,
                                     start_new_session=True, cwd=str(ROOT))
        while time.perf_counter() - t < self.start_timeout:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} (log: {self.log})")
            try:
                with urllib.request.urlopen(f"{self.url}/v1/models", timeout=2) as resp:
                    if resp.status == 200:
                        return time.perf_counter() - t
            except OSError:
                pass
            time.sleep(1.0)
        self.stop()
        raise RuntimeError(f"{self.name} did not answer within {self.start_timeout:.0f} s (log: {self.log})")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def peer_python(flag: str | None, env: str) -> tuple[str | None, str]:
    """The peer's interpreter (flag, else environment variable) and, if it cannot be used, why."""
    python = flag or os.environ.get(env)
    if not python:
        return None, f"not configured (--{'vllm' if 'VLLM' in env else 'llama-cpp'}-python or {env})"
    if not Path(python).is_file():
        return None, f"{python} does not exist"
    return python, ""


def package_version(python: str, dist: str) -> str:
    code = f"import importlib.metadata as m; print(m.version({dist!r}))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    return out.stdout.strip() or "?"


def make_servers(args: argparse.Namespace, checkpoint: str, gguf: str) -> tuple[dict[str, Server], dict[str, str]]:
    servers: dict[str, Server] = {}
    absent: dict[str, str] = {}
    n = len(cores())
    if "prefixserve" in args.systems:
        servers["prefixserve"] = Server(
            "prefixserve", [sys.executable, "-m", "service", "serve", "--host", "127.0.0.1", "--port", "{port}",
                            "--served-model-name", MODEL, "--max-num-waiting", "100000", "--log-level", "warning",
                            *args.prefixserve_args],
            {}, 0, 600, {"ignore_eos": True}, version=package_version(sys.executable, "prefixserve"))
    if "vllm" in args.systems:
        python, why = peer_python(args.vllm_python, "PREFIXSERVE_PEER_VLLM")
        if python is None:
            absent["vllm"] = why
        else:
            bind = f"{min(cores())}-{max(cores())}"
            servers["vllm"] = Server(
                "vllm", [python, "-m", "vllm.entrypoints.openai.api_server", "--model", checkpoint,
                         "--served-model-name", MODEL, "--dtype", "bfloat16", "--enable-prefix-caching",
                         "--host", "127.0.0.1", "--port", "{port}", "--max-model-len", "2048",
                         "--disable-log-stats"],
                {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": bind, "OMP_NUM_THREADS": str(n),
                 "VLLM_TARGET_DEVICE": "cpu"},
                0, 1200, {"ignore_eos": True}, version=package_version(python, "vllm-cpu"))
    if "llama.cpp" in args.systems:
        python, why = peer_python(args.llama_cpp_python, "PREFIXSERVE_PEER_LLAMA_CPP")
        if python is None:
            absent["llama.cpp"] = why
        else:
            servers["llama.cpp"] = Server(
                "llama.cpp", [python, "-m", "llama_cpp.server", "--model", gguf, "--model_alias", MODEL,
                              "--n_threads", str(n), "--n_ctx", "4096", "--n_batch", "512", "--host", "127.0.0.1",
                              "--port", "{port}", "--interrupt_requests", "False"],   # queue, not cut, requests
                {}, 0, 300, {"min_tokens": "{max_tokens}"}, version=package_version(python, "llama_cpp_python"))
    return servers, absent


# -- one request --------------------------------------------------------------------------------------------
@dataclass
class Timing:
    ok: bool = False
    error: str = ""
    ttft: float = 0.0
    e2e: float = 0.0
    tokens: int = 0


def sampling_fields(server: Server, max_tokens: int) -> dict[str, Any]:
    return {k: (max_tokens if v == "{max_tokens}" else v) for k, v in server.sampling.items()}


async def request(session: aiohttp.ClientSession, server: Server, path: str, body: dict[str, Any]) -> Timing:
    """One streamed request; TTFT at the first chunk that carries text, tokens from the final usage (or, if a
    server sends none, one per text chunk)."""
    body = {**body, "model": MODEL, "stream": True, "stream_options": {"include_usage": True}, "temperature": 0.0,
            **sampling_fields(server, body["max_tokens"])}
    res = Timing()
    chunks = 0
    usage_tokens = None
    t0 = time.perf_counter()
    try:
        async with session.post(server.url + path, json=body) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            buf = b""
            async for data in resp.content.iter_any():
                buf += data
                while b"\n\n" in buf:
                    event, buf = buf.split(b"\n\n", 1)
                    event = event.strip()
                    if not event.startswith(b"data: {"):
                        continue
                    chunk = json.loads(event[6:])
                    if "error" in chunk:
                        res.error = str(chunk["error"])[:300]
                        return res
                    if chunk.get("usage"):
                        usage_tokens = chunk["usage"].get("completion_tokens")
                    for c in chunk.get("choices") or []:
                        text = c.get("text") if "text" in c else (c.get("delta") or {}).get("content")
                        if text:
                            chunks += 1
                            if not res.ttft:
                                res.ttft = time.perf_counter() - t0
        res.e2e = time.perf_counter() - t0
        res.tokens = usage_tokens if usage_tokens is not None else chunks
        res.ok = res.tokens == body["max_tokens"]
        if not res.ok:
            res.error = f"got {res.tokens} of {body['max_tokens']} tokens"
    except (TimeoutError, aiohttp.ClientError) as exc:
        res.error = repr(exc)
    return res


async def run_requests(server: Server, items: list[tuple[str, dict[str, Any]]], concurrency: int,
                       desc: str) -> tuple[list[Timing], float]:
    """All items through at most `concurrency` at a time; (timings in item order, wall seconds)."""
    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(items), desc=desc, leave=False)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                     timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def one(path: str, body: dict[str, Any]) -> Timing:
            async with sem:
                r = await request(session, server, path, body)
            bar.update(1)
            return r

        t = time.perf_counter()
        out = await asyncio.gather(*(one(p, b) for p, b in items))
        wall = time.perf_counter() - t
    bar.close()
    failed = [r.error for r in out if not r.ok]
    if failed:
        raise RuntimeError(f"{server.name}, {desc}: {len(failed)} of {len(out)} requests failed: {failed[0]}")
    return list(out), wall


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


# -- prompts ------------------------------------------------------------------------------------------------
def text_of_tokens(tokenizer: Any, n: int, rng: random.Random) -> str:
    """A text of random words that the model's tokenizer encodes to exactly `n` tokens."""
    words: list[str] = []
    while len(tokenizer.encode(" ".join(words), add_special_tokens=False)) < n + 8:
        words += rng.choices(WORDS, k=16)
    ids = tokenizer.encode(" ".join(words), add_special_tokens=False)[:n]
    text = tokenizer.decode(ids)
    while len(tokenizer.encode(text, add_special_tokens=False)) > n:
        text = text[:-1]
    return text


@dataclass
class Workload:
    throughput: list[str]
    single: list[str]
    system: str
    questions: list[str]
    loadgen_seed: int


def workload(tokenizer: Any, seed: int) -> Workload:
    rng = random.Random(seed)
    return Workload([text_of_tokens(tokenizer, 128, rng) for _ in range(64)],
                    [text_of_tokens(tokenizer, 128, rng) for _ in range(3)],
                    text_of_tokens(tokenizer, 1024, rng),
                    [text_of_tokens(tokenizer, 32, rng) for _ in range(32)], seed)


# -- the workloads ------------------------------------------------------------------------------------------
def run_throughput(server: Server, w: Workload) -> dict[str, float]:
    items = [("/v1/completions", {"prompt": p, "max_tokens": 128}) for p in w.throughput]
    res, wall = asyncio.run(run_requests(server, items, len(items), "throughput"))
    return {"throughput_tok_s": sum(r.tokens for r in res) / wall}


def run_single(server: Server, w: Workload) -> dict[str, float]:
    items = [("/v1/completions", {"prompt": p, "max_tokens": 128}) for p in w.single]
    res, _ = asyncio.run(run_requests(server, items, 1, "single"))
    return {"single_ttft_ms": 1000 * statistics.median(r.ttft for r in res),
            "single_decode_tok_s": statistics.median((r.tokens - 1) / (r.e2e - r.ttft) for r in res)}


def run_shared(server: Server, w: Workload, named: str | None) -> dict[str, float]:
    def body(q: str) -> dict[str, Any]:
        if named is not None:
            return {"prefix": named, "messages": [{"role": "user", "content": q}], "max_tokens": 64}
        return {"messages": [{"role": "system", "content": w.system}, {"role": "user", "content": q}],
                "max_tokens": 64}

    items = [("/v1/chat/completions", body(q)) for q in w.questions]
    res, wall = asyncio.run(run_requests(server, items, 8, "shared" + (" named" if named else "")))
    key = "shared_named" if named else "shared"
    ttfts = [1000 * r.ttft for r in res]
    return {f"{key}_ttft_p50_ms": pct(ttfts, 50), f"{key}_ttft_p90_ms": pct(ttfts, 90),
            f"{key}_tok_s": sum(r.tokens for r in res) / wall}


def register(server: Server, name: str, system: str) -> None:
    body = json.dumps({"name": name, "messages": [{"role": "system", "content": system}]}).encode()
    req = urllib.request.Request(server.url + "/v1/prefixes", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as resp:
        assert resp.status in (200, 201), resp.status


def run_loadgen(server: Server, w: Workload, vllm_python: str | None, checkpoint: str,
                num_prompts: int) -> dict[str, float]:
    if vllm_python is None:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        argv = [vllm_python, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "openai",
                "--base-url", server.url, "--endpoint", "/v1/completions", "--model", MODEL,
                "--tokenizer", checkpoint, "--dataset-name", "random", "--random-input-len", "128",
                "--random-output-len", "64", "--request-rate", "2", "--num-prompts", str(num_prompts),
                "--seed", str(w.loadgen_seed), "--save-result", "--result-dir", tmp,
                "--result-filename", "r.json", "--disable-tqdm"]
        # every request generates exactly 64 tokens: the way each server is told so (sampling_fields)
        argv += ["--ignore-eos"] if "ignore_eos" in server.sampling else \
            ["--extra-body", json.dumps(sampling_fields(server, 64))]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=1800,
                             env={**os.environ, "VLLM_TARGET_DEVICE": "cpu"})
        path = Path(tmp) / "r.json"
        if out.returncode != 0 or not path.is_file():
            raise RuntimeError(f"vllm bench serve against {server.name} failed: {out.stderr[-800:]}")
        r = json.loads(path.read_text())
    if r.get("completed", 0) != num_prompts:
        raise RuntimeError(f"vllm bench serve against {server.name}: {r.get('completed')} of {num_prompts} completed")
    return {"loadgen_req_s": r["request_throughput"], "loadgen_ttft_p50_ms": r["median_ttft_ms"],
            "loadgen_tpot_p50_ms": r["median_tpot_ms"]}


GUIDELLM_REQUESTS = 24


def run_guidellm(server: Server, guidellm: str | None, checkpoint: str) -> dict[str, float]:
    """guidellm's own client (streaming chat completions) against the server; every request must complete."""
    if guidellm is None:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "g.json"
        argv = [guidellm, "run", "--backend", f"kind=openai_http,target={server.url}",
                "--profile", "kind=concurrent,streams=4",
                "--constraint", f"kind=max_requests,count={GUIDELLM_REQUESTS}",
                "--data", "kind=synthetic_text,prompt_tokens=128,output_tokens=32",
                "--tokenizer", f"kind=hf_auto,model={checkpoint}", "--disable-console-interactive",
                "--output", f"kind=json,path={path}"]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=900, cwd=tmp,
                             env={**os.environ, "HF_HUB_OFFLINE": "1"})
        if out.returncode != 0 or not path.is_file():
            raise RuntimeError(f"guidellm against {server.name} failed: {(out.stdout + out.stderr)[-800:]}")
        metrics = json.loads(path.read_text())["benchmarks"][0]["metrics"]
    totals = metrics["request_totals"]
    if totals["successful"] != GUIDELLM_REQUESTS:
        raise RuntimeError(f"guidellm against {server.name}: {totals['successful']} of {GUIDELLM_REQUESTS} completed, "
                           f"{totals['errored']} errors")
    return {"guidellm_ttft_p50_ms": metrics["time_to_first_token_ms"]["successful"]["median"],
            "guidellm_tok_s": metrics["output_tokens_per_second"]["successful"]["mean"]}


def run_system(server: Server, w: Workload, args: argparse.Namespace, vllm_python: str | None, checkpoint: str,
               log_dir: Path, name: str) -> dict[str, Any]:
    """Starts the server, warms it (2 short requests), runs every workload, stops it."""
    server.port = free_port()
    server.argv = [a.replace("{port}", str(server.port)) for a in server.argv]
    figures: dict[str, Any] = {"start_s": server.start(log_dir), "load": {}}
    try:
        warm = [("/v1/completions", {"prompt": w.single[0], "max_tokens": 8})] * 2
        asyncio.run(run_requests(server, warm, 1, "warm-up"))
        steps: list[tuple[str, Callable[[], dict[str, float]]]] = [
            ("throughput", lambda: run_throughput(server, w)),
            ("single", lambda: run_single(server, w)),
            ("shared", lambda: run_shared(server, w, None)),
        ]
        if server.name == "prefixserve":
            steps.append(("shared_named", lambda: (register(server, name, w.system), run_shared(server, w, name))[1]))
        if server.name == "llama.cpp":
            # vllm bench serve always sends vLLM's `ignore_eos` and `repetition_penalty`, which
            # llama-cpp-python's server refuses (400 on every request, measured): no figure for it
            figures.setdefault("failed", {})["loadgen"] = ("vllm bench serve sends ignore_eos and repetition_penalty, "
                                                           "which llama-cpp-python's server refuses (400)")
        else:
            steps.append(("loadgen", lambda: run_loadgen(server, w, vllm_python, checkpoint, args.loadgen_prompts)))
        if server.name != "llama.cpp":       # one request at a time there (its server queues them)
            steps.append(("guidellm", lambda: run_guidellm(server, args.guidellm, checkpoint)))
        for step, fn in steps:
            if step not in args.workloads:
                continue
            figures["load"][step] = os.getloadavg()[0]
            try:
                figures |= fn()
            except RuntimeError as exc:         # this workload only: the system's other figures stand
                print(f"{server.name}, {step}: {exc}", file=sys.stderr)
                figures.setdefault("failed", {})[step] = str(exc)[:500]
    finally:
        server.stop()
    return figures


# -- report -------------------------------------------------------------------------------------------------
def ratio(ours: float | None, theirs: float | None, higher: bool) -> float | None:
    """How many times better ours is (> 1: ours wins), whichever way the figure points."""
    if ours is None or theirs is None or ours <= 0 or theirs <= 0:
        return None
    return ours / theirs if higher else theirs / ours


def report(medians: dict[str, dict[str, float]], systems: list[str], absent: dict[str, str]) -> tuple[str, dict]:
    peers = [s for s in systems if s != "prefixserve"]
    head = "| figure | " + " | ".join(systems) + " | " + " | ".join(f"ours vs {p}" for p in peers) + " |"
    lines = [head, "|---|" + "---:|" * (len(systems) + len(peers))]
    ratios: dict[str, dict[str, float | None]] = {p: {} for p in peers}
    for key, (label, higher, unit) in FIGURES.items():
        if not any(key in medians.get(s, {}) for s in systems):
            continue
        cells = []
        for s in systems:
            v = medians.get(s, {}).get(key)
            cells.append("—" if v is None else (f"{v:,.0f} {unit}" if v >= 100 else f"{v:.2f} {unit}"))
        rs = []
        for p in peers:
            r = ratio(medians.get("prefixserve", {}).get(key), medians.get(p, {}).get(key), higher)
            ratios[p][key] = r
            rs.append("—" if r is None else (f"**{r:.2f}x**" if r >= 1 else f"{r:.2f}x"))
        lines.append(f"| {label} | " + " | ".join(cells) + " | " + " | ".join(rs) + " |")
    lines.append("")
    lines.append("Ratios: how many times better ours is (> 1: ours wins; for latencies theirs / ours).")
    for s, why in absent.items():
        lines.append(f"\n**{s}: absent** ({why}): no figure, no ratio.")
    return "\n".join(lines), ratios


def main(argv: list[str] | None = None, prog: str = "prefixserve bench peers") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    ap.add_argument("--workloads", nargs="+",
                    default=["throughput", "single", "shared", "shared_named", "loadgen", "guidellm"])
    ap.add_argument("--guidellm", default=os.environ.get("PREFIXSERVE_GUIDELLM"),
                    help="guidellm's executable, in its own venv (or PREFIXSERVE_GUIDELLM); no guidellm figures "
                         "without it")
    ap.add_argument("--vllm-python", default=None, help="the vLLM venv's python (or PREFIXSERVE_PEER_VLLM)")
    ap.add_argument("--llama-cpp-python", default=None, help="llama-cpp-python's venv python "
                                                             "(or PREFIXSERVE_PEER_LLAMA_CPP)")
    ap.add_argument("--prefixserve-args", nargs=argparse.REMAINDER, default=[],
                    help="extra `prefixserve serve` flags (last on the line)")
    ap.add_argument("--loadgen-prompts", type=int, default=60)
    ap.add_argument("--model", default=None, help="a GGUF (default: the built-in model's)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--quick", action="store_true", help="one round")
    args = ap.parse_args(argv)
    if args.quick:
        args.rounds = 1
    from transformers import AutoTokenizer

    from engine.models.default import default_model_path
    from engine.models.loader import resolve_model_path

    gguf = args.model or str(default_model_path())
    checkpoint = str(resolve_model_path(gguf))           # converts (and caches) it on first use
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    servers, absent = make_servers(args, checkpoint, gguf)
    vllm_python = servers["vllm"].argv[0] if "vllm" in servers else peer_python(args.vllm_python,
                                                                                 "PREFIXSERVE_PEER_VLLM")[0]
    if "loadgen" in args.workloads and vllm_python is None:
        absent["vllm bench serve"] = "the load generator needs the vLLM venv"
    if "guidellm" in args.workloads and args.guidellm is None:
        absent["guidellm"] = "not installed (--guidellm PATH: `pip install guidellm` in a venv of its own)"
    log_dir = Path(tempfile.mkdtemp(prefix="prefixserve-peers-"))
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in servers}
    base = {s: list(servers[s].argv) for s in servers}
    for r in range(args.rounds):
        w = workload(tokenizer, args.seed + r)            # fresh prompts every round
        order = list(servers) if r % 2 == 0 else list(servers)[::-1]
        for s in order:
            servers[s].argv = list(base[s])
            try:
                figures = run_system(servers[s], w, args, vllm_python, checkpoint, log_dir, f"sys-{r}")
            except RuntimeError as exc:
                print(f"{s}: {exc}", file=sys.stderr)
                absent[s] = f"failed in round {r + 1}: {exc}"
                continue
            runs[s].append(figures)
            print(f"round {r + 1} {s}: " + json.dumps({k: round(v, 2) for k, v in figures.items()
                                                       if isinstance(v, float)}), file=sys.stderr)
    medians = {s: {k: statistics.median(f[k] for f in fs if k in f) for k in FIGURES if any(k in f for f in fs)}
               for s, fs in runs.items() if fs}
    systems = [s for s in SYSTEMS if s in medians]
    table, ratios = report(medians, systems, {s: why for s, why in absent.items() if s not in medians or "failed" in
                                              why})
    loads = {s: [f["load"] for f in fs] for s, fs in runs.items()}
    failures = {(s, step): why for s, fs in runs.items() for f in fs for step, why in f.get("failed", {}).items()}
    for (s, step), why in failures.items():         # once each, however many rounds it failed in
        table += f"\n\n**{s}, {step}: failed** ({why[:300]})"
    table += (f"\n\nMedians over {args.rounds} round(s), systems alternating; 1-minute load average before each "
              f"workload: " + "; ".join(f"{s} {json.dumps(v)}" for s, v in loads.items()) +
              "\n\nVersions: " + ", ".join(f"{s} {servers[s].version}" for s in servers) +
              f". Model: {Path(gguf).name} (prefixserve, llama.cpp), {Path(checkpoint).name} in bfloat16 (vLLM).")
    fig, (ax,) = new_figure(width=9.0, height=4.5)
    keys = [k for k in FIGURES if any(ratios[p].get(k) for p in ratios)]
    for i, p in enumerate(ratios):
        ax.bar([x + 0.4 * i for x in range(len(keys))], [ratios[p].get(k) or 0 for k in keys], 0.4,
               label=f"ours vs {p}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([x + 0.2 for x in range(len(keys))], [k.removesuffix("_ms").removesuffix("_tok_s") for k in keys],
                  rotation=35, ha="right", fontsize=7)
    ax.set_ylabel("times better (> 1: ours wins)")
    ax.legend()
    payload = {"medians": medians, "ratios": ratios, "runs": runs, "absent": absent,
               "versions": {s: servers[s].version for s in servers}, "rounds": args.rounds}
    write_results("peers", table, payload, args.out, fig, command_line(prog, argv))
    print_result({"ratios": ratios, "absent": absent})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
