"""The benchmark tool: `memory` end to end through the CLI on a tiny trace, and the pure helpers of
`sharing`, `prefix` and `memory` on inputs small enough to check by hand."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks import cli
from benchmarks.common import median_ratio, random_prompts
from benchmarks.offline import memory, prefix, sharing
from engine.kv.block_manager import BlockManager, PrefixHit
from engine.kv.block_pool import BlockPool


def result_line(out: str) -> dict:
    last = out.strip().splitlines()[-1]
    assert last.startswith("RESULT "), last
    return json.loads(last[len("RESULT "):])


def test_memory_through_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["memory", "--quick", "--num-requests", "40", "--memory-tokens", "8192", "--out", str(tmp_path)])
    assert rc == 0
    res = result_line(capsys.readouterr().out)
    for name in ("memory.md", "memory.png", "memory.json"):
        assert (tmp_path / name).stat().st_size > 0
    for key in ("paged_utilization", "contiguous_utilization", "pow2_utilization", "oracle_utilization"):
        assert 0.0 < res[key] <= 1.0, (key, res[key])
    assert res["paged_utilization"] > res["oracle_utilization"] > res["contiguous_utilization"]
    assert res["paged_utilization"] >= 0.9
    assert res["max_batch_paged"] > res["max_batch_contiguous"] == 8192 // memory.MAX_MODEL_LEN
    saved = json.loads((tmp_path / "memory.json").read_text())
    assert saved["result"] == res and saved["png"] == "memory.png"
    command = "prefixserve bench memory --quick --num-requests 40 --memory-tokens 8192 --out " + str(tmp_path)
    assert saved["command"] == command
    assert saved["machine"]["torch"] and "device" in saved["machine"]
    assert "![memory](memory.png)" in (tmp_path / "memory.md").read_text()


def test_cli_usage_and_unknown_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main([]) == 2
    with pytest.raises(SystemExit):
        cli.main(["nope"])


def test_kernels_without_cuda_exits_cleanly(capsys: pytest.CaptureFixture[str]) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the kernels benchmark would really run")
    assert cli.main(["kernels", "--quick"]) == 1
    assert "CUDA" in capsys.readouterr().err


# -- memory helpers ------------------------------------------------------------------------------
def test_reservation_policies() -> None:
    assert [memory.next_pow2(x) for x in (1, 2, 3, 25, 32, 33)] == [1, 2, 4, 32, 32, 64]
    assert memory.reservation("Orca (Max)", 100, 25) == memory.MAX_MODEL_LEN
    assert memory.reservation("Orca (Pow2)", 100, 25) == 132
    assert memory.reservation("Orca (Pow2)", 2000, 40) == memory.MAX_MODEL_LEN   # capped
    assert memory.reservation("Orca (Oracle)", 100, 25) == 125


def test_first_fit_merges_holes() -> None:
    heap = memory.FirstFit(100)
    a, b, c = heap.alloc(30), heap.alloc(30), heap.alloc(30)
    assert (a, b, c) == (0, 30, 60) and heap.alloc(20) is None
    heap.free(b, 30)
    assert heap.alloc(40) is None            # 30 + 10 free, but not contiguous: external fragmentation
    heap.free(c, 30)
    assert heap.holes == [(30, 70)]
    heap.free(a, 30)
    assert heap.holes == [(0, 100)]


def test_replays_on_a_hand_checked_trace() -> None:
    # one request, prompt 16, output 16, block size 16: paged holds 1 block for the prompt, then 2
    trace = [(16, 16)]
    paged = memory.replay_paged(trace, 1024).summary()
    assert paged["steps"] == 16 and paged["max_batch"] == 1 and paged["preemptions"] == 0
    # live / reserved: 16/16, then 17..31 tokens in 2 blocks (32 slots)
    expected = (1 + sum(n / 32 for n in range(17, 32))) / 16
    assert paged["utilization"] == pytest.approx(expected)
    oracle = memory.replay_contiguous(trace, 1024, "Orca (Oracle)").summary()
    assert oracle["utilization"] == pytest.approx(sum(n / 32 for n in range(16, 32)) / 16)
    cmax = memory.replay_contiguous(trace * 3, 4096, "Orca (Max)").summary()
    assert cmax["max_batch"] == 2                 # 4096 slots hold two 2048-slot reservations


def test_paged_replay_preempts_instead_of_failing() -> None:
    # 4 blocks of memory, two requests that each grow to 3 blocks: the younger is preempted, both finish
    rep = memory.replay_paged([(16, 30), (16, 30)], 64)
    assert rep.preemptions >= 1 and rep.summary()["max_batch"] == 2


# -- sharing helpers -----------------------------------------------------------------------------
def test_blocks_saved() -> None:
    assert sharing.blocks_saved([2, 3, 3], [4, 6, 6]) == pytest.approx(0.5)
    assert sharing.blocks_saved([1], [0]) == 0.0


def test_fork_by_copy_duplicates_blocks_and_queues_copies() -> None:
    pool = BlockPool(16)
    manager = BlockManager(pool, 4, "fp", enable_prefix_caching=False)
    assert manager.allocate(0, list(range(10)), PrefixHit((), 0), 10)           # 3 blocks
    sharing.set_sharing(manager, False)
    manager.fork(0, 1)
    assert pool.stats().used == 6
    parent, child = manager.block_table(0), manager.block_table(1)
    assert not set(parent) & set(child)
    assert manager.pending_copies == list(zip(parent, child))
    sharing.set_sharing(manager, True)
    manager.fork(0, 2)                              # the class's own fork again: shares by reference
    assert manager.block_table(2) == parent and pool.stats().used == 6
    for seq in (0, 1, 2):
        manager.free(seq)
    assert pool.stats().used == 0


# -- prefix helpers ------------------------------------------------------------------------------
def test_hit_rate_counts_full_prefix_blocks() -> None:
    assert prefix.hit_rate([1024, 1024], 1024, 16) == 1.0
    assert prefix.hit_rate([1024, 0], 1024, 16) == 0.5
    assert prefix.hit_rate([1088], 1030, 16) == 1.0      # suffix hits and the partial block do not count
    assert prefix.hit_rate([], 1024, 16) == 0.0


def test_fewshot_prompts_share_exactly_the_prefix() -> None:
    shot = list(range(3, 83))
    prompts = prefix.fewshot_prompts(shot, 5, 300, seed=0)
    assert len(prompts) == 5 and all(p[:80] == shot and 16 <= len(p) - 80 <= 48 for p in prompts)
    assert prompts == prefix.fewshot_prompts(shot, 5, 300, seed=0)


def test_common_helpers() -> None:
    assert median_ratio([2.0, 3.0, 10.0], [1.0, 3.0, 1.0]) == 2.0
    a, b = random_prompts([5, 7], 50, seed=1)
    assert (len(a), len(b)) == (5, 7) and all(3 <= t < 50 for t in a + b)


def test_prefix_quick_on_a_tiny_checkpoint(tiny_llama_dir: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["prefix", "--quick", "--reps", "2", "--prefix-len", "256", "--model", str(tiny_llama_dir),
                   "--out", str(tmp_path)])
    assert rc == 0
    res = result_line(capsys.readouterr().out)
    assert (tmp_path / "prefix.png").exists() and (tmp_path / "prefix.json").exists()
    assert res["pinned_hit_rate"] == 1.0
    assert 0.0 <= res["lru_hit_rate"] < 1.0
    assert res["ttft_cached_s"] > 0 and res["ttft_uncached_s"] > 0


def test_results_go_to_a_scratch_folder_unless_out(capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.common import RESULTS
    committed = {p.name: p.stat().st_mtime_ns for p in RESULTS.iterdir()}
    rc = cli.main(["memory", "--quick", "--num-requests", "20", "--memory-tokens", "4096"])
    assert rc == 0
    err = capsys.readouterr().err
    where = Path(err.split("results go to ", 1)[1].split(" ", 1)[0])
    assert (where / "memory.md").exists() and where.resolve() != RESULTS.resolve()
    assert {p.name: p.stat().st_mtime_ns for p in RESULTS.iterdir()} == committed


# -- routing --------------------------------------------------------------------------------------
def test_routing_workload_and_summary() -> None:
    from argparse import Namespace

    from benchmarks.served import routing

    class Words:                                   # a tokenizer of whitespace words: lengths by hand
        def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
            return [0] * len(text.split())

    args = Namespace(seed=3, tenants=4, system_len=40, question_len=8, num_requests=50, rate=5.0)
    systems, reqs = routing.make_workload(args, Words())
    again = routing.make_workload(args, Words())
    assert (systems, reqs) == again                                   # same requests for every policy
    assert len(systems) == 4 and all(len(s.split()) >= 40 for s in systems)
    assert len(reqs) == 50 and {r.tenant for r in reqs} == {0, 1, 2, 3}
    gaps = [b.at - a.at for a, b in zip(reqs, reqs[1:])]
    assert reqs[0].at == 0 and all(g > 0 for g in gaps) and 0.1 < sum(gaps) / len(gaps) < 0.4   # ~1/rate
    outs = [routing.Outcome(True, "", 0.1 * i, 100, 60, 8) for i in range(1, 5)] + [routing.Outcome(error="x")]
    s = routing.summarize(outs, 2.0, [3, 1, 0])
    assert s["hit_rate"] == 0.6 and s["errors"] == 1 and s["requests_per_s"] == 2.0
    assert s["output_tokens_per_s"] == 16.0 and s["served_per_replica"] == [3, 1, 0]
    assert abs(s["ttft_ms_p50"] - 250.0) < 1e-9 and s["first_errors"] == ["x"]


@pytest.mark.slow
def test_routing_through_the_real_router(tiny_llama_dir: Path, tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["routing", "--model", str(tiny_llama_dir), "--num-requests", "12", "--tenants", "3",
                   "--system-len", "64", "--rate", "20", "--output-len", "4", "--num-kv-blocks", "64",
                   "--policies", "round_robin,registered", "--out", str(tmp_path)])
    assert rc == 0
    res = result_line(capsys.readouterr().out)
    assert res["errors"] == 0 and res["hit_rate_registered"] > res["hit_rate_round_robin"]
    saved = json.loads((tmp_path / "routing.json").read_text())
    assert [sum(saved["runs"][p]["served_per_replica"]) for p in ("round_robin", "registered")] == [12, 12]
    assert saved["runs"]["round_robin"]["served_per_replica"] == [4, 4, 4]


def test_vattention_bench_on_a_tiny_checkpoint(tiny_llama_dir: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["vattention", "--quick", "--model", str(tiny_llama_dir), "--batches", "1", "3", "--contexts", "46",
                   "--decode-steps", "3", "--out", str(tmp_path)])
    assert rc == 0
    res = result_line(capsys.readouterr().out)
    assert res["decode_ratio_median"] > 0 and res["prefill_ratio_median"] > 0
    assert res["decode_stalls_after_warmup"] == 0 and res["map_us_per_page"] > 0
    rows = json.loads((tmp_path / "vattention.json").read_text())["result"]["rows"]
    assert [(r["batch"], r["context"]) for r in rows] == [(1, 46), (3, 46)]
    assert all(r["ahead_maps"] > 0 for r in rows)          # each decode crossed into a new page (position 48)
    assert (tmp_path / "vattention.png").stat().st_size > 0


def test_decode_bench_on_a_tiny_checkpoint(tiny_llama_dir: Path, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["decode", "--model", str(tiny_llama_dir), "--quantizations", "none", "--compiled", "none",
                   "--output-len", "4", "--rounds", "1", "--out", str(tmp_path)])
    assert rc == 0
    res = result_line(capsys.readouterr().out)
    # no GGUF, so no llama.cpp: reported absent, and no ratio made up from a figure recorded elsewhere
    assert res["llama_cpp"] is None and res["batch1_vs_llama_cpp"] is None
    assert "llama.cpp | absent" in (tmp_path / "decode.md").read_text()
    rows = json.loads((tmp_path / "decode.json").read_text())["result"]["rows"]
    assert [r["name"] for r in rows] == ["prefixserve, none", "prefixserve, none, compiled"]
    assert all(r["batch1_tok_s"] > 0 and r["streams16_tok_s"] > 0 and r["start_s"] > 0 for r in rows)
    assert "| prefixserve, none, compiled |" in (tmp_path / "decode.md").read_text()


def test_threads_bench_on_a_tiny_checkpoint(tiny_llama_dir: Path, tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    rc = cli.main(["threads", "--model", str(tiny_llama_dir), "--rounds", "1", "--prefill-len", "200",
                   "--out", str(tmp_path)])
    if len(os.sched_getaffinity(0)) < 2:
        assert rc == 1
        return
    assert rc == 0
    res = result_line(capsys.readouterr().out)
    assert set(res) == {f"slowdown_{m}_{i}" for m in ("fixed", "adaptive") for i in (0, 1)}
    assert all(v > 0 for v in res.values())
    runs = json.loads((tmp_path / "threads.json").read_text())["runs"]
    assert runs["fixed"][0]["changes"]["count"] == 0               # no governor, no changes
    assert all(runs[m][0][p]["8 x 128 in / 32 out"] > 0 for m in ("fixed", "adaptive")
               for p in ("alone", "busy", "alone again"))
    assert "| 8 x 128 in / 32 out, busy |" in (tmp_path / "threads.md").read_text()


# -- isolation ------------------------------------------------------------------------------------
def test_isolation_auc_is_mann_whitney() -> None:
    from benchmarks.served.isolation import prompt, roc_auc
    assert roc_auc([3.0], [1.0, 2.0]) == 1.0 and roc_auc([0.0], [1.0, 2.0]) == 0.0
    assert roc_auc([1.0, 1.0], [1.0, 1.0]) == 0.5                  # a classifier that sees nothing
    assert roc_auc([2.0, 0.0], [1.0]) == 0.5
    a, b = prompt(0, 1234, 1), prompt(0, 5678, 1)
    assert a.startswith("PIN 1234") and a[8:] == b[8:]             # the secret first, the rest the same


# -- gemm -----------------------------------------------------------------------------------------
def test_gemm_crossovers_by_hand() -> None:
    from benchmarks.offline.gemm import crossovers
    ms = {"a": [1.0, 2.0, 4.0], "b": [3.0, 2.5, 3.0]}
    assert crossovers([1, 8, 64], ms) == ["b overtakes a between 8 and 64 rows"]
    assert crossovers([1, 8], {"a": [1.0, 2.0], "b": [3.0, 3.0]}) == []


def test_gemm_bench_through_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Every path timed at each row count, the dispatch's choice as the op layer makes it, oneDNN's kernel named."""
    from kernels.ops import default_ops
    rc = cli.main(["gemm", "--rows", "1,12", "--reps", "1", "--layers", "1", "--out", str(tmp_path)])
    assert rc == 0
    res = result_line(capsys.readouterr().out)
    assert res["rows"] == [1, 12] and {"int4", "dense"} <= set(res["ms"])
    assert all(len(v) == 2 and min(v) > 0 for v in res["ms"].values())
    ops = default_ops()
    bf16 = [p for p in res["ms"] if p.startswith("gemm_bf16")]
    assert bool(bf16) == ops.wide_int4_bf16
    from kernels import quant_gemm as qg
    for r in ("1", "12"):
        assert res["fastest"][r] in res["ms"]
        if ops.bf16_gemm_step(False, int(r)):
            assert res["dispatched"][r].startswith("gemm_bf16")
        elif ops.own_wide_step(False, int(r)):           # float32 GEMMs: the panel-decoding int4 GEMM, timed too
            q16 = ops.wide_int4_q16                     # with VNNI, its int4 x int16 variant
            assert res["dispatched"][r].startswith("c++ int4 gemm_q16" if q16 else "c++ int4 gemm_wide")
            assert any(p.startswith("gemm_wide") for p in res["ms"])
            assert any(p.startswith("gemm_q16") for p in res["ms"]) == q16
        elif ops.narrow_int4:                       # float32 GEMMs (AVX2): our int4 GEMMs for decode steps
            assert res["dispatched"][r].startswith("c++ int4")
        else:
            assert res["dispatched"][r] == ("dense" if int(r) >= qg.DENSE_FROM_ROWS else "int4")
    saved = json.loads((tmp_path / "gemm.json").read_text())
    if qg.ONEDNN:   # one line a row count, from the ONEDNN_VERBOSE process; a lone row goes in as two (dense_mm)
        assert sorted(k.split(" x ")[0] for k in saved["onednn"] if " x 576 x 3072 " in k) == ["12", "2"]
    assert "ISA:" in (tmp_path / "gemm.md").read_text() and (tmp_path / "gemm.png").stat().st_size > 0


def test_kernels_bench_checks_each_cpu_build_by_its_own_criterion() -> None:
    """`bench kernels --device cpu` checks every build's decode against torch's before timing it: an AVX-512 BF16
    build's bf16 products by their criterion (0.5% of the largest |V|), not float32 rounding (which failed them)."""
    import torch

    from benchmarks.offline import kernels as kbench
    from kernels.cpu.library import runnable_variants

    variants = runnable_variants()
    if not variants:
        pytest.skip("no build of the C++ CPU kernels runs here")
    for shared in (0, 512):     # each sequence its own blocks; a shared prefix (the cascade) checked too
        row = kbench.cpu_decode_row(6, 1024, variants, torch.Generator().manual_seed(0), shared=shared)
        assert row["shared"] == shared and all(row[f"{v}_us"] > 0 for v in variants)
