"""Two load generators none of us wrote, run against each server:

    loadgen       `vllm bench serve` (from the vLLM venv), random 128 in / 64 out, Poisson 2 req/s, 60 requests:
                  req/s, TTFT p50, TPOT p50
    guidellm      guidellm (its own venv: --guidellm, or PREFIXSERVE_GUIDELLM), streaming chat, 4 concurrent
                  streams, 24 synthetic requests of 128 in / 32 out: requests completed (all must), TTFT p50
                  and output tok/s
"""
from __future__ import annotations

import json
import os
import subprocess
import tempfile
from pathlib import Path

from benchmarks.served.peers.client import sampling_fields
from benchmarks.served.peers.servers import MODEL, Server

GUIDELLM_REQUESTS = 24


def run_loadgen(server: Server, seed: int, vllm_python: str | None, checkpoint: str,
                num_prompts: int) -> dict[str, float]:
    if vllm_python is None:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        argv = [vllm_python, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "openai",
                "--base-url", server.url, "--endpoint", "/v1/completions", "--model", MODEL,
                "--tokenizer", checkpoint, "--dataset-name", "random", "--random-input-len", "128",
                "--random-output-len", "64", "--request-rate", "2", "--num-prompts", str(num_prompts),
                "--seed", str(seed), "--save-result", "--result-dir", tmp,
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
