"""The contention run: the shared-prefix workload (a 1,024-token system prompt + 32-token questions, 64 out,
concurrency 8) on the quiet machine, then again beside one busy neighbour, a spinning Python process pinned to
one of the cores the servers run on (the last one this process may use). Both passes run back to back in the
same server session, each with a system prompt of its own (so each computes its prefix once); a system's
slowdown is its busy figure over its quiet one, so every system is compared with itself.

The neighbour's share of its core during the busy pass is recorded (`contention_neighbour_cpu`, CPU seconds
over wall seconds: near 1 when it kept its core the whole time).
"""
from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

from benchmarks.served.peers.loads import run_shared
from benchmarks.served.peers.prompts import SHARED_OUT, Workload
from benchmarks.served.peers.servers import Server, cores

SPIN = ("import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nprint('ready', flush=True)\n"
        "while True:\n    pass\n")


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a live process, from /proc/<pid>/stat."""
    stat = open(f"/proc/{pid}/stat").read()
    fields = stat[stat.rindex(")") + 2:].split()         # after "pid (comm) ": field 3 (state) onwards
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def busy_neighbour(core: int) -> Iterator[subprocess.Popen[bytes]]:
    """A process that spins on `core` for as long as the block runs; killed (and reaped) however it ends."""
    proc = subprocess.Popen([sys.executable, "-c", SPIN, str(core)], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"ready":          # it pinned itself before saying so
            raise RuntimeError(f"the busy neighbour did not start (exit code {proc.wait()})")
        yield proc
    finally:
        proc.kill()
        proc.wait()


def run_contention(server: Server, w: Workload, core: int | None = None,
                   max_tokens: int = SHARED_OUT) -> dict[str, float]:
    core = cores()[-1] if core is None else core
    quiet_prompt, busy_prompt = w.contention
    quiet = run_shared(server, quiet_prompt, "quiet", max_tokens=max_tokens)
    with busy_neighbour(core) as neighbour:
        t, cpu = time.perf_counter(), cpu_seconds(neighbour.pid)
        busy = run_shared(server, busy_prompt, "busy", max_tokens=max_tokens)
        share = (cpu_seconds(neighbour.pid) - cpu) / (time.perf_counter() - t)
    return {"contention_quiet_ttft_p50_ms": quiet["quiet_ttft_p50_ms"],
            "contention_busy_ttft_p50_ms": busy["busy_ttft_p50_ms"],
            "contention_slowdown_ttft_p50": busy["busy_ttft_p50_ms"] / quiet["quiet_ttft_p50_ms"],
            "contention_slowdown_ttft_p90": busy["busy_ttft_p90_ms"] / quiet["quiet_ttft_p90_ms"],
            "contention_slowdown_tok_s": quiet["quiet_tok_s"] / busy["busy_tok_s"],
            "contention_quiet_tok_s": quiet["quiet_tok_s"], "contention_busy_tok_s": busy["busy_tok_s"],
            "contention_core": float(core), "contention_neighbour_cpu": share}
