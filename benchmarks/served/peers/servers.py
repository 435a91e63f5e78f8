"""The three OpenAI servers of `bench peers`, each started on loopback as a process group of its own.

    prefixserve   `python -m service serve` (this checkout), the built-in model as it serves by default
    vLLM CPU      `<vllm venv>/bin/python -m vllm.entrypoints.openai.api_server` on the float32 checkpoint
                  our GGUF loader caches, --dtype bfloat16 (--vllm-dtype), --enable-prefix-caching, its OpenMP threads
                  bound to the cores this process may use (VLLM_CPU_OMP_THREADS_BIND), 4 GiB of KV cache
    llama.cpp     `<llama venv>/bin/python -m llama_cpp.server` on the GGUF itself (its own 4-bit kernels);
                  one request at a time (its server queues them: --interrupt_requests False)

Every server gets the model's whole context (`context`: max_position_embeddings of the checkpoint) as its
length limit, so the long-prompt workloads fit all three the same way.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[3]
SYSTEMS = ("prefixserve", "vllm", "llama.cpp")
MODEL = "m"                     # the served model name every server is given


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

    def start(self, log_dir: Path, extra_env: dict[str, str] | None = None) -> float:
        """Starts the server on a free port (`{port}` in argv); the seconds until it answered /v1/models.
        Raises RuntimeError if it never does."""
        self.port = free_port()
        argv = [a.replace("{port}", str(self.port)) for a in self.argv]
        self.log = log_dir / f"{self.name}-{self.port}.log"
        t = time.perf_counter()
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(argv, env={**os.environ, **self.env, **(extra_env or {})}, stdout=out,
                                         stderr=subprocess.STDOUT, start_new_session=True, cwd=str(ROOT))
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

    def stop(self, timeout: float = 30.0) -> None:
        """SIGTERM to the server's process group; returns once every process of the group has exited (SIGKILL to
        what is left after `timeout` s). Not only its leader: vLLM's engine core is a child process, and one still
        spinning its OpenMP threads after the API server exited would run beside the next system's workload."""
        proc = self.proc
        if proc is None:
            return

        def running() -> bool:
            return proc.poll() is None or group_alive(proc.pid)

        for sig, wait_s in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            if not running():
                return
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
            deadline = time.monotonic() + wait_s
            while running() and time.monotonic() < deadline:
                time.sleep(0.1)


def group_alive(pgid: int) -> bool:
    """Whether a process of group `pgid` still runs (a zombie does not: exited, only not reaped yet), from /proc;
    False where there is no /proc."""
    proc = Path("/proc")
    if not proc.is_dir():
        return False
    for d in proc.iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()      # after "pid (comm) ": state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


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


def vllm_server(python: str, checkpoint: str, dtype: str, max_model_len: int, threads: int = 0,
                extra: tuple[str, ...] = ()) -> Server:
    """vLLM's OpenAI server on its CPU backend: the checkpoint in `dtype`, prefix caching on, its OpenMP threads
    bound to `threads` of the cores this process may use (0: all of them), 4 GiB of KV cache unless `extra`
    (more flags, last on the line) sizes it otherwise."""
    use = cores()[:threads] if threads > 0 else cores()
    return Server(
        "vllm", [python, "-m", "vllm.entrypoints.openai.api_server", "--model", checkpoint,
                 "--served-model-name", MODEL, "--dtype", dtype, "--enable-prefix-caching",
                 "--host", "127.0.0.1", "--port", "{port}", "--max-model-len", str(max_model_len),
                 "--disable-log-stats", *extra],
        {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": ",".join(map(str, use)),
         "OMP_NUM_THREADS": str(len(use)), "VLLM_TARGET_DEVICE": "cpu"},
        0, 1200, {"ignore_eos": True}, version=package_version(python, "vllm-cpu"))


def make_servers(args: argparse.Namespace, checkpoint: str, gguf: str,
                 context: int) -> tuple[dict[str, Server], dict[str, str]]:
    servers: dict[str, Server] = {}
    absent: dict[str, str] = {}
    n = len(cores())
    if "prefixserve" in args.systems:
        model = ["--model", gguf] if args.model else []          # else the built-in model, as it serves by default
        servers["prefixserve"] = Server(
            "prefixserve", [sys.executable, "-m", "service", "serve", "--host", "127.0.0.1", "--port", "{port}",
                            "--served-model-name", MODEL, "--max-num-waiting", "100000", "--log-level", "warning",
                            *model, *args.prefixserve_args],
            {}, 0, 600, {"ignore_eos": True}, version=package_version(sys.executable, "prefixserve"))
    if "vllm" in args.systems:
        python, why = peer_python(args.vllm_python, "PREFIXSERVE_PEER_VLLM")
        if python is None:
            absent["vllm"] = why
        else:
            servers["vllm"] = vllm_server(python, checkpoint, args.vllm_dtype, context)
    if "llama.cpp" in args.systems:
        python, why = peer_python(args.llama_cpp_python, "PREFIXSERVE_PEER_LLAMA_CPP")
        if not gguf.endswith(".gguf"):
            absent["llama.cpp"] = f"{gguf} is not a GGUF file"
        elif python is None:
            absent["llama.cpp"] = why
        else:
            servers["llama.cpp"] = Server(
                "llama.cpp", [python, "-m", "llama_cpp.server", "--model", gguf, "--model_alias", MODEL,
                              "--n_threads", str(n), "--n_ctx", str(context), "--n_batch", "512",
                              "--host", "127.0.0.1", "--port", "{port}",
                              "--interrupt_requests", "False"],   # queue, not cut, requests
                {}, 0, 300, {"min_tokens": "{max_tokens}"}, version=package_version(python, "llama_cpp_python"))
    return servers, absent
