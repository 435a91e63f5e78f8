"""The quantized layers' GEMM paths against each other at each step width, on this CPU, and which one the dispatch
picks: the measurement behind kernels/quant_gemm.py's crossovers (DENSE_FROM_ROWS, AMX_DENSE_FROM_ROWS), to run on
each CPU the engine serves on (an AMX one above all: no crossover there is measured yet).

    prefixserve bench gemm [--quick] [--rows 1,4,8,...] [--reps N] [--threads T] [--out DIR]

One pass = SmolLM2-135M's 120 projections (30 layers of qkv 960 x 576, o 576 x 576, gate_up 3,072 x 576, down
576 x 1,536: the built-in model's shapes, random 4-bit weights, a scale and a zero per group of 32), on a step of
R rows of bfloat16 activations; a projection's weights are read once a pass, as a decode step reads them. Paths:

- int4: torch's int4 kernel (`_weight_int4pack_mm_for_cpu`: a matrix-vector product a row), what a GGUF Q4 layer's
  narrow decode steps took before gemm_bf16;
- gemm_bf16 (<build>): our int4 x bfloat16 GEMM (kernels/cpu/int4_gemm.py), in each C++ build this CPU runs that
  has it (AVX-512 BF16: avx512_bf16, amx), checked against dense before it is timed;
- gemm_wide (<build>): our panel-decoding int4 GEMM on float32 activations (kernels/cpu/int4_gemm.py), in the build
  the engine runs, where the dense GEMM is float32 (AVX2, AVX-512 without BF16): what its wide decode steps take;
- gemm_q16 (<build>): the same panels as 16-bit integer pairs times int16 activations (vpdpwssd), where the build
  has AVX-512 and the CPU VNNI: what prompt chunks and wide decode steps take on such a CPU without BF16;
- dense: oneDNN's GEMM on the layer's dense copy (quant_gemm.pack_dense: bfloat16 where oneDNN has a bfloat16
  GEMM, on AMX's tile units where the CPU has them; float32 elsewhere), what prompt chunks and wide steps take
  where gemm_bf16 does not.

The paths alternate pass by pass; each figure is the median of `--reps` passes. Reported per row count: ms per pass,
the fastest path, the path the engine's dispatch gives a GGUF Q4 layer's decode step of that width (kernels/ops.py
Ops.linear; prompt chunks in a line of their own), and where each pair of paths crosses. Which kernel oneDNN ran
for the dense GEMM comes from one more process with ONEDNN_VERBOSE=1 (its implementation name: `avx10_1_512_amx`
on AMX). The GEMMs only: a whole decode step also pays for the layers' other work, which gemm_bf16's C++ layer
calls cut (kernels/cpu/layers.py), so the engine's thresholds can sit below these crossovers.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from benchmarks.common import command_line, cpu_info, cpu_line, new_figure, print_result, write_results

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))      # (out, in) of a SmolLM2 layer's projections
LAYERS = 30
ROWS = (1, 2, 4, 8, 10, 12, 16, 32, 64, 128, 512)
QUICK_ROWS = (1, 8, 64)
AGREE = 2 ** -7                   # gemm_bf16 against dense: max |diff| / max |dense| (bfloat16 outputs: 2 ulps)


def make_layers(n_layers: int, seed: int) -> list[dict[str, Any]]:
    """Each projection's weights as every path reads them."""
    from kernels import quant_gemm as qg
    from kernels.cpu import int4_gemm
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_layers):
        for n, k in SHAPES:
            q = torch.randint(0, 16, (n, k), generator=g)
            s = torch.rand(n, k // qg.GROUP, generator=g) * 0.02 + 0.001
            z = torch.randn(n, k // qg.GROUP, generator=g) * 0.01
            sb, zb = s.to(qg.ACT).float(), z.to(qg.ACT).float()
            packed, sz = qg.pack_int4(q, s, z)
            w4, sz4 = int4_gemm.pack_bf16(q, sb, zb) if int4_gemm.fits_bf16(n, k) else (None, None)
            w8, sz8 = int4_gemm.pack(q, sb, zb)
            out.append({"n": n, "k": k, "packed": packed, "sz": sz, "w4": w4, "sz4": sz4, "w8": w8, "sz8": sz8,
                        "dense": qg.pack_dense(qg.dequantize_int4(q, sb, zb))})
    return out


def bf16_builds() -> dict[str, Any]:
    """build name -> its int4 kernels, for each C++ build this CPU runs that has gemm_bf16."""
    from kernels.cpu.library import KernelUnavailable, load, runnable_variants
    out = {}
    for v in runnable_variants():
        try:
            k = load(v)
        except KernelUnavailable:
            continue
        if k.int4.has_bf16:
            out[v] = k.int4
    return out


def path_calls(builds: dict[str, Any]) -> dict[str, Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]]:
    """path name -> its GEMM of a step's activations by one projection (as make_layers holds it)."""
    from kernels import quant_gemm as qg
    calls: dict[str, Callable[[torch.Tensor, dict[str, Any]], torch.Tensor]] = {
        "int4": lambda x, w: qg.int4_mm(x, w["packed"], w["sz"]),
        "dense": lambda x, w: qg.dense_mm(x, w["dense"], None)}
    for name, kern in builds.items():
        calls[f"gemm_bf16 ({name})"] = lambda x, w, kern=kern: kern.gemm_bf16(x, w["w4"], w["sz4"])
    from kernels.ops import default_ops
    ops = default_ops()
    if ops.cpu is not None and qg.DENSE_DTYPE == torch.float32:
        own = ops.cpu.int4
        calls[f"gemm_wide ({ops.cpu.variant})"] = lambda x, w: own.gemm_wide(x.float(), w["w8"], w["sz8"])
        if own.has_q16:
            calls[f"gemm_q16 ({ops.cpu.variant})"] = lambda x, w: own.gemm_q16(x.float(), w["w8"], w["sz8"])
    return calls


def run_pass(gemm: Callable[[torch.Tensor, dict[str, Any]], torch.Tensor], layers: list[dict[str, Any]],
             xs: dict[int, torch.Tensor]) -> None:
    for w in layers:
        gemm(xs[w["k"]], w)


def agreement(layers: list[dict[str, Any]], builds: dict[str, Any], rows: int) -> dict[str, float]:
    """gemm_bf16 of each build against the dense GEMM on the first layer: max |diff| / max |dense|."""
    from kernels import quant_gemm as qg
    out = {}
    for name, kern in builds.items():
        worst = 0.0
        for w in layers[:len(SHAPES)]:
            x = torch.randn(rows, w["k"]).to(torch.bfloat16)
            ref = qg.dense_mm(x, w["dense"], None).float()
            got = kern.gemm_bf16(x, w["w4"], w["sz4"]).float()
            worst = max(worst, float((got - ref).abs().max() / ref.abs().max().clamp(min=1e-30)))
        out[name] = worst
    return out


def dispatched(rows: int, prefill: bool) -> str:
    """The path the engine's op layer gives a GGUF Q4 layer's step (kernels/ops.py Ops.linear)."""
    from kernels import quant_gemm as qg
    from kernels.ops import default_ops
    ops = default_ops()
    if ops.bf16_gemm_step(prefill, rows):
        return f"gemm_bf16 ({ops.cpu.variant if ops.cpu is not None else '?'})"
    if ops.own_wide_step(prefill, rows) and ops.cpu is not None:   # float32 GEMMs: the panel-decoding int4 GEMM
        if ops.wide_int4_q16:
            return f"c++ int4 gemm_q16 ({ops.cpu.variant}, int16 activations)"
        return f"c++ int4 gemm_wide ({ops.cpu.int4.wide_path}, float32)"
    if prefill or rows >= qg.DENSE_FROM_ROWS:
        return "dense"
    return "c++ int4 (float32)" if ops.narrow_int4 else "int4"


def crossovers(rows: list[int], ms: dict[str, list[float]]) -> list[str]:
    """For each pair of paths, the first row count from which the second is at least as fast as the first, where
    the first was faster before it."""
    out = []
    names = list(ms)
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            for first, second in ((a, b), (b, a)):
                for j in range(1, len(rows)):
                    if ms[first][j - 1] < ms[second][j - 1] and ms[second][j] <= ms[first][j]:
                        out.append(f"{second} overtakes {first} between {rows[j - 1]} and {rows[j]} rows")
    return out


ONEDNN_PROBE = """
import torch
from kernels import quant_gemm as qg
w = qg.pack_dense(torch.randn(3072, 576))
for r in ROWS:
    qg.dense_mm(torch.randn(r, 576).to(torch.bfloat16), w, None)
"""


def onednn_kernels(rows: list[int]) -> list[str]:
    """`M x K x N: implementation` of each dense GEMM shape, from a process run with ONEDNN_VERBOSE=1."""
    from benchmarks.served.peers.onednn import parse_verbose
    env = dict(os.environ, ONEDNN_VERBOSE="1", DNNL_VERBOSE="1")
    env["PYTHONPATH"] = os.pathsep.join([os.getcwd(), *sys.path])
    try:
        proc = subprocess.run([sys.executable, "-c", ONEDNN_PROBE.replace("ROWS", repr(rows))], env=env,
                              capture_output=True, text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return ["(the oneDNN probe timed out)"]
    v = parse_verbose(proc.stdout.splitlines())
    lines = [f"{g.m} x {g.k} x {g.n} ({g.src} x {g.wei}): {g.impl}" for g in v.gemms or []]
    return lines or [f"(no oneDNN GEMM line; rc {proc.returncode}: {proc.stderr.strip()[-200:]})"]


def main(argv: list[str] | None = None, prog: str = "prefixserve bench gemm") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help=f"rows {QUICK_ROWS}, 3 passes, 4 layers")
    ap.add_argument("--rows", default=None, help=f"comma-separated row counts (default {','.join(map(str, ROWS))})")
    ap.add_argument("--reps", type=int, default=None, help="passes per path and row count (default 9, --quick 3)")
    ap.add_argument("--layers", type=int, default=None, help=f"layers of projections a pass (default {LAYERS}, "
                    "--quick 4)")
    ap.add_argument("--threads", type=int, default=0, help="torch's (and the kernels') threads; 0: as the engine "
                    "takes them (every core this process may use)")
    ap.add_argument("--out", type=Path, default=None, help="where the .md, .png and .json go (default: a scratch "
                    "folder)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    rows = [int(r) for r in args.rows.split(",")] if args.rows else list(QUICK_ROWS if args.quick else ROWS)
    reps = args.reps or (3 if args.quick else 9)
    n_layers = args.layers or (4 if args.quick else LAYERS)
    threads = args.threads or len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    from kernels import quant_gemm as qg
    builds = bf16_builds()
    calls = path_calls(builds)
    paths = list(calls)
    layers = make_layers(n_layers, args.seed)
    ms: dict[str, list[float]] = {p: [] for p in paths}
    agree: dict[int, dict[str, float]] = {}
    with tqdm(total=len(rows) * reps, desc="gemm") as bar:
        for r in rows:
            agree[r] = agreement(layers, builds, r)
            bad = {b: e for b, e in agree[r].items() if not e <= AGREE}
            if bad:
                print(f"{prog}: gemm_bf16 disagrees with the dense GEMM at {r} rows: {bad}", file=sys.stderr)
                return 1
            xs = {k: torch.randn(r, k).to(torch.bfloat16) for k in {w["k"] for w in layers}}
            times: dict[str, list[float]] = {p: [] for p in paths}
            for _ in range(reps):
                for p in paths:
                    t = time.perf_counter()
                    run_pass(calls[p], layers, xs)
                    times[p].append(time.perf_counter() - t)
                bar.update()
            for p in paths:
                ms[p].append(statistics.median(times[p]) * 1e3)
    info = cpu_info()
    head = "| rows | " + " | ".join(paths) + " | fastest | the engine's decode step |\n|---:|" + \
        "---:|" * len(paths) + "---|---|\n"
    lines = []
    for i, r in enumerate(rows):
        fastest = min(paths, key=lambda p: ms[p][i])
        lines.append(f"| {r} | " + " | ".join(f"{ms[p][i]:.2f} ms" for p in paths) + f" | {fastest} | "
                     f"{dispatched(r, False)} |")
    cross = crossovers(rows, ms)
    kernels = onednn_kernels(rows)
    table = (f"CPU: {cpu_line(info, threads)}; {threads} threads; oneDNN bfloat16 GEMM: "
             f"{'yes' if qg.ONEDNN_BF16 else 'no (dense is float32)'}.\n\n" + head + "\n".join(lines) +
             f"\n\nPrompt chunks take: {dispatched(64, True)}. One pass: {n_layers} layers' projections "
             f"({len(layers)} GEMMs); medians of {reps} passes, paths alternating. gemm_bf16 against dense, max "
             f"|diff| / max |dense| over a layer: {max((e for d in agree.values() for e in d.values()), default=0):.4f}"
             f" at most.\n\nCrossovers: " + ("; ".join(cross) or "none in these rows") +
             ".\n\noneDNN's kernel for the dense GEMM (ONEDNN_VERBOSE):\n\n" + "\n".join(f"- {k}" for k in kernels)
             + f"\n\n1-minute load average at the end: {os.getloadavg()[0]:.2f}.")
    print(table)
    fig, axes = new_figure(1, width=7.0)
    for p in paths:
        axes[0].plot(rows, ms[p], marker="o", label=p)
    axes[0].set_xscale("log", base=2)
    axes[0].set_yscale("log")
    axes[0].set_xlabel("rows in the step")
    axes[0].set_ylabel(f"ms per pass ({len(layers)} projections; lower is better)")
    axes[0].set_title(info["name"])
    axes[0].legend()
    fastest = {str(r): min(paths, key=lambda p: ms[p][i]) for i, r in enumerate(rows)}
    result = {"rows": rows, "ms": {p: [round(x, 3) for x in v] for p, v in ms.items()}, "fastest": fastest,
              "dispatched": {str(r): dispatched(r, False) for r in rows}, "prefill": dispatched(64, True)}
    write_results("gemm", table, {"result": result, "crossovers": cross, "onednn": kernels, "agreement": agree,
                                  "threads": threads, "layers": n_layers, "reps": reps},
                  out_dir=args.out, figure=fig, command=command_line(prog, argv))
    print_result(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
