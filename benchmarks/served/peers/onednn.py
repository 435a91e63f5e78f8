"""Which kernel oneDNN picked for each GEMM shape, per system: the server started once more with
ONEDNN_VERBOSE=1 (outside the timed rounds: the verbose lines cost time), a short load that steps through
the shapes the workloads produce (a lone request, 8 questions after a shared 1,024-token prompt, 16 prompts at
once; 8 tokens out each), then its log parsed.

A verbose line of an executed primitive (oneDNN 3.x; 2.x wrote `dnnl_verbose,exec,...` and `src_f32`):

    onednn_verbose,v1,primitive,exec,cpu,inner_product,brg_matmul:avx2,forward_inference,
        src:f32::blocked:ab::f0 wei:f32::blocked:ab::f0 bia:undef::undef::: dst:f32::blocked:ab::f0,
        attr-scratchpad:user,,mb8ic576oc1536,0.964111
    onednn_verbose,v1,primitive,exec,cpu,matmul,brg_matmul:avx10_1_512_amx,undef,src:bf16::blocked:ab::f0 ...,
        ,,64x576:576x1536,0.0219971

GEMMs are matmul and inner_product primitives: (kind, M, K, N, source / weight types, implementation) -> calls
and milliseconds; other primitives are counted by kind. A GEMM that never went through oneDNN (torch's own
kernels, ggml) leaves no line: a system with no GEMM line ran none there. Other log lines that name oneDNN are
kept as notes (vLLM 0.32 on an AVX2-only CPU: "Failed to create oneDNN linear, fallback to torch linear").
"""
from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.served.peers.client import run_requests
from benchmarks.served.peers.prompts import Workload
from benchmarks.served.peers.servers import Server

VERBOSE_ENV = {"ONEDNN_VERBOSE": "1", "DNNL_VERBOSE": "1"}
GEMMS = ("matmul", "inner_product")
MAX_NOTES = 5
_DTYPE = re.compile(r"\b(src|wei|dst)[:_]([a-z0-9]+)")
_IP = re.compile(r"mb(\d+)ic(\d+).*?oc(\d+)")


@dataclass
class Gemm:
    kind: str
    m: int
    k: int
    n: int
    src: str
    wei: str
    impl: str
    batch: str = ""                       # leading batch dims of a batched matmul, "2x4"
    calls: int = 0
    ms: float = 0.0


@dataclass
class Verbose:
    version: str = ""                     # "oneDNN v3.12.0"
    isa: str = ""                         # what oneDNN says it may use: "Intel AVX2"
    gemms: list[Gemm] | None = None
    other: dict[str, int] | None = None   # executions of other primitives, by kind
    notes: list[str] | None = None        # what the server's own log says of oneDNN (a fallback, an error)

    def as_dict(self) -> dict[str, Any]:
        return {"version": self.version, "isa": self.isa, "gemms": [asdict(g) for g in self.gemms or []],
                "other": self.other or {}, "notes": self.notes or []}


def gemm_shape(kind: str, desc: str) -> tuple[int, int, int, str] | None:
    """(M, K, N, batch) from a problem description: `64x576:576x1536` (matmul, src:weights[:bias]) or
    `mb8ic576oc1536` (inner_product); None if it is neither."""
    if kind == "inner_product":
        m = _IP.search(desc)
        return (int(m[1]), int(m[2]), int(m[3]), "") if m else None
    parts = desc.split(":")
    if len(parts) < 2:
        return None
    try:
        src = [int(x) for x in parts[0].split("x")]
        wei = [int(x) for x in parts[1].split("x")]
    except ValueError:                    # runtime dimensions (`*`): no shape to report
        return None
    if len(src) < 2 or len(wei) < 2:
        return None
    return src[-2], src[-1], wei[-1], "x".join(map(str, src[:-2]))


def parse_verbose(lines: Iterable[str]) -> Verbose:
    out = Verbose(gemms=[], other={}, notes=[])
    seen: dict[tuple[Any, ...], Gemm] = {}
    assert out.gemms is not None and out.other is not None and out.notes is not None
    for line in lines:
        if not line.startswith(("onednn_verbose", "dnnl_verbose")):
            note = line.strip().rsplit("] ", 1)[-1][:240]        # after a logger's "(Worker pid=..) ... [file:line] "
            if "onednn" in line.lower() and note not in out.notes and len(out.notes) < MAX_NOTES:
                out.notes.append(note)
            continue
        f = line.rstrip("\n").split(",")
        if "info" in f[1:3]:
            text = ",".join(f[f.index("info") + 1:])
            if text.startswith("oneDNN v"):
                out.version = text.split(" (")[0]
            elif ",isa:" in "," + text:
                out.isa = text.split("isa:", 1)[1].strip()
            continue
        if "exec" not in f[1:5] or "graph" in f[1:4]:
            continue
        i = f.index("exec")
        if len(f) < i + 10:
            continue
        kind, impl, mds, desc, ms = f[i + 2], f[i + 3], f[i + 5], f[i + 8], f[i + 9]
        if kind not in GEMMS:
            out.other[kind] = out.other.get(kind, 0) + 1
            continue
        shape = gemm_shape(kind, desc)
        if shape is None:
            out.other[kind] = out.other.get(kind, 0) + 1
            continue
        types = dict(_DTYPE.findall(mds))
        key = (kind, *shape, types.get("src", "?"), types.get("wei", "?"), impl)
        g = seen.get(key)
        if g is None:
            g = seen[key] = Gemm(kind, shape[0], shape[1], shape[2], key[5], key[6], impl, shape[3])
            out.gemms.append(g)
        g.calls += 1
        try:
            g.ms += float(ms)
        except ValueError:
            pass
    out.gemms.sort(key=lambda g: (g.kind, g.k, g.n, g.m, g.impl))
    return out


def ranges(xs: Iterable[int]) -> str:
    """`1-9, 16, 32-33` from the sorted distinct values."""
    vals = sorted(set(xs))
    spans: list[tuple[int, int]] = []
    for v in vals:
        if spans and v == spans[-1][1] + 1:
            spans[-1] = (spans[-1][0], v)
        else:
            spans.append((v, v))
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def table(per_system: dict[str, dict[str, Any]]) -> str:
    """Markdown: per system, each weight shape (K x N, types) and implementation with the rows (M) it ran at."""
    lines = ["| system | primitive | K x N | src / wei | implementation | M (rows) | calls |",
             "|---|---|---|---|---|---|---:|"]
    notes = []
    for system, v in per_system.items():
        if "error" in v:
            notes.append(f"{system}: not recorded ({v['error'][:200]})")
            continue
        groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
        for g in v["gemms"]:
            groups.setdefault((g["kind"], g["k"], g["n"], g["src"], g["wei"], g["impl"], g["batch"]), []).append(g)
        for (kind, k, n, src, wei, impl, batch), gs in groups.items():
            shape = f"{k} x {n}" + (f" (batch {batch})" if batch else "")
            lines.append(f"| {system} | {kind} | {shape} | {src} / {wei} | `{impl}` | {ranges(g['m'] for g in gs)} | "
                         f"{sum(g['calls'] for g in gs)} |")
        said = "".join(f"; its log: \"{n}\"" for n in v.get("notes", []))
        if not groups:
            spoke = f" ({v['version']}, ISA {v['isa']} loaded)" if v["version"] else " (oneDNN never spoke)"
            notes.append(f"{system}: no GEMM went through oneDNN{spoke}{said}")
        else:
            notes.append(f"{system}: {v['version']}, ISA: {v['isa']}{said}")
    return "\n".join(lines) + "\n\n" + "; ".join(notes) + "."


def run_onednn(server: Server, w: Workload, log_dir: Path) -> dict[str, Any]:
    """Starts the server with oneDNN's verbose output on, runs the short load, stops it, parses its log."""
    server.start(log_dir, extra_env=VERBOSE_ENV)
    try:
        loads = [
            ([("/v1/completions", {"prompt": w.single[0], "max_tokens": 8})], 1),
            ([("/v1/chat/completions", {"messages": [{"role": "system", "content": w.shared.system},
                                                     {"role": "user", "content": q}], "max_tokens": 8})
              for q in w.shared.questions[:8]], 8),
            ([("/v1/completions", {"prompt": p, "max_tokens": 8}) for p in w.throughput[:16]], 16),
        ]
        for items, concurrency in loads:
            asyncio.run(run_requests(server, items, concurrency, "oneDNN verbose"))
    finally:
        server.stop()
    assert server.log is not None
    with server.log.open(errors="replace") as f:
        return parse_verbose(f).as_dict()
