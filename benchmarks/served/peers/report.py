"""The table of `bench peers`: each system's median per figure, and how many times better ours is than each
peer, from the rounds in which both produced the figure (paired: they ran back to back in the same run, never
against a figure recorded elsewhere)."""
from __future__ import annotations

import statistics
from typing import Any

from benchmarks.served.peers.prompts import (
    LONG_CONCURRENCY,
    LONG_QUESTION,
    MANY_CONCURRENCY,
    MANY_QUESTION,
    MANY_SYSTEM,
    SESSION_SYSTEM,
    SESSION_TURN,
    SHARED_CONCURRENCY,
    Sizes,
)

OURS = "prefixserve"
_S = Sizes()
_LONG = f"+ distinct {LONG_QUESTION}-token questions, 64 out, {_S.long} req, conc. {LONG_CONCURRENCY}"

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
    "long3k_ttft_p50_ms": (f"shared 3,072-token system prompt {_LONG}: TTFT p50", False, "ms"),
    "long3k_ttft_p90_ms": ("same: TTFT p90", False, "ms"),
    "long3k_tok_s": ("same: output tok/s", True, "tok/s"),
    "long8k_ttft_p50_ms": (f"shared 8,192-token system prompt (cut to fit the context) {_LONG}: TTFT p50", False, "ms"),
    "long8k_ttft_p90_ms": ("same: TTFT p90", False, "ms"),
    "long8k_tok_s": ("same: output tok/s", True, "tok/s"),
    "many_ttft_p50_ms": (f"{_S.systems} distinct {MANY_SYSTEM}-token system prompts x {_S.users} users + "
                         f"{MANY_QUESTION}, 64 out, conc. {MANY_CONCURRENCY}: TTFT p50", False, "ms"),
    "many_ttft_p90_ms": ("same: TTFT p90", False, "ms"),
    "many_tok_s": ("same: output tok/s", True, "tok/s"),
    "sessions_total_s": (f"{_S.sessions} chat sessions x {_S.turns} turns ({SESSION_SYSTEM}-token system prompt, "
                         f"{SESSION_TURN}-token turns, 64 out), whole history resent: total time", False, "s"),
    "sessions_ttft_p50_ms": ("same: TTFT p50", False, "ms"),
    "sessions_ttft_p90_ms": ("same: TTFT p90", False, "ms"),
    "contention_quiet_ttft_p50_ms": (f"shared 1,024-token prefix, {_S.shared} req, conc. {SHARED_CONCURRENCY}, "
                                     "quiet: TTFT p50", False, "ms"),
    "contention_busy_ttft_p50_ms": ("same, one busy process pinned beside the server: TTFT p50", False, "ms"),
    "contention_slowdown_ttft_p50": ("contention slowdown (busy / quiet): TTFT p50", False, "x"),
    "contention_slowdown_ttft_p90": ("contention slowdown: TTFT p90", False, "x"),
    "contention_slowdown_tok_s": ("contention slowdown: output tok/s (quiet / busy)", False, "x"),
}


def ratio(ours: float | None, theirs: float | None, higher: bool) -> float | None:
    """How many times better ours is (> 1: ours wins), whichever way the figure points."""
    if ours is None or theirs is None or ours <= 0 or theirs <= 0:
        return None
    return ours / theirs if higher else theirs / ours


def paired_ratio(runs: dict[str, list[dict[str, Any]]], peer: str, key: str, higher: bool) -> float | None:
    """Median over the rounds in which both ours and `peer` produced `key` of ours vs theirs in that round;
    None when no round has both."""
    theirs = {f["round"]: f for f in runs.get(peer, [])}
    pairs = [ratio(f[key], theirs[f["round"]][key], higher) for f in runs.get(OURS, [])
             if key in f and key in theirs.get(f["round"], {})]
    rs = [r for r in pairs if r is not None]
    return statistics.median(rs) if rs else None


def medians(runs: dict[str, list[dict[str, Any]]]) -> dict[str, dict[str, float]]:
    """Each system's median of each figure over the rounds that produced it."""
    return {s: {k: statistics.median(f[k] for f in fs if k in f) for k in FIGURES if any(k in f for f in fs)}
            for s, fs in runs.items() if fs}


def cell(v: float | None, unit: str) -> str:
    if v is None:
        return "—"
    if unit == "x":
        return f"{v:.2f}x"
    return f"{v:,.0f} {unit}" if v >= 100 else f"{v:.2f} {unit}"


def report(runs: dict[str, list[dict[str, Any]]], systems: list[str],
           absent: dict[str, str]) -> tuple[str, dict[str, dict[str, float | None]]]:
    """(markdown table, ratios per peer per figure). `systems`: those that produced figures, ours first."""
    meds = medians(runs)
    peers = [s for s in systems if s != OURS] if OURS in systems else []
    lines = ["| " + " | ".join(["figure", *systems, *(f"ours vs {p}" for p in peers)]) + " |",
             "|---|" + "---:|" * (len(systems) + len(peers))]
    ratios: dict[str, dict[str, float | None]] = {p: {} for p in peers}
    for key, (label, higher, unit) in FIGURES.items():
        if not any(key in meds.get(s, {}) for s in systems):
            continue
        cells = [cell(meds.get(s, {}).get(key), unit) for s in systems]
        rs = []
        for p in peers:
            r = ratios[p][key] = paired_ratio(runs, p, key, higher)
            rs.append("—" if r is None else (f"**{r:.2f}x**" if r >= 1 else f"{r:.2f}x"))
        lines.append("| " + " | ".join([label, *cells, *rs]) + " |")
    lines.append("")
    lines.append("Ratios: how many times better ours is (> 1: ours wins; for latencies and slowdowns theirs / ours), "
                 "the median of the per-round ratios over the rounds in which both systems produced the figure.")
    for s, why in absent.items():
        lines.append(f"\n**{s}: absent** ({why}): no figure, no ratio.")
    return "\n".join(lines), ratios
