"""`bench tier`'s multi-turn part without vLLM running: the KV cache and length limit every system gets (ours in
16-token blocks, vLLM's in 32-token blocks plus its null block), vLLM's command line, the report with and
without a vLLM row, a cache too small for one history refused before anything starts, and (slow) the part
end to end on a tiny checkpoint with vLLM not configured."""
from __future__ import annotations

import json
import shutil
import sys
from argparse import Namespace
from pathlib import Path

import pytest

from benchmarks import cli
from benchmarks.served import tier, tier_sessions
from benchmarks.served.peers.servers import cores, vllm_server
from benchmarks.served.tier_sessions import Sizes, sizes


def test_both_caches_hold_the_same_tokens_and_the_longest_history() -> None:
    # --quick: 4 sessions x 3 turns x (160 + 32): 2,304 tokens, a third 768 = 48 of ours, 24 of vLLM's + its null
    assert sizes(4, 3, 160, 32) == Sizes(total=2304, longest=576, blocks=48, vllm_blocks=25)
    full = sizes(12, 6, 224, 32)                                      # the defaults
    assert (full.total, full.longest, full.blocks, full.vllm_blocks) == (18432, 1536, 384, 193)
    assert full.tokens == full.vllm_tokens == 6144
    odd = sizes(5, 3, 100, 30)                          # 1,950 // 3 = 650 tokens, up to whole vLLM blocks: 672
    assert (odd.blocks, odd.vllm_blocks, odd.tokens, odd.vllm_tokens) == (42, 22, 672, 672)
    # 2 sessions: a third (256) is less than one history (384): the cache holds the history (2x, not 3x)
    two = sizes(2, 2, 160, 32)
    assert (two.blocks, two.vllm_blocks, two.tokens, two.longest) == (24, 13, 384, 384)
    given = sizes(4, 3, 160, 32, blocks=49)             # an odd count of ours: vLLM rounds up to a whole block
    assert (given.tokens, given.vllm_blocks, given.vllm_tokens) == (784, 26, 800)
    with pytest.raises(ValueError, match="fewer than one session's final history"):
        sizes(4, 3, 160, 32, blocks=35)                  # 560 tokens < 576


def test_vllm_gets_the_sizes_threads_and_prompt_token_details() -> None:
    size = sizes(4, 3, 160, 32)
    server = vllm_server(sys.executable, "/ckpt", "float32", size.longest, 1, tier_sessions.vllm_flags(size))
    argv = server.argv
    assert argv[argv.index("--max-model-len") + 1] == "576" and argv[argv.index("--dtype") + 1] == "float32"
    assert argv[-7:] == ["--block-size", "32", "--num-gpu-blocks-override", "25", "--max-num-seqs", "8",
                         "--enable-prompt-tokens-details"]
    assert "--enable-prefix-caching" in argv and argv[argv.index("--model") + 1] == "/ckpt"
    assert server.env["OMP_NUM_THREADS"] == "1" and server.env["VLLM_CPU_OMP_THREADS_BIND"] == str(cores()[0])
    every = vllm_server(sys.executable, "/ckpt", "float32", 576).env        # threads 0: every core
    assert every["VLLM_CPU_OMP_THREADS_BIND"] == ",".join(map(str, cores()))
    assert every["OMP_NUM_THREADS"] == str(len(cores()))


def fake(ttfts: list[float], cached: int, prompt: int, **more: object) -> dict:
    rows = [{"turn": 0, "session": 0, "ttft": 9.0, "cached": 0, "prompt": prompt}]          # turn 1: left out
    rows += [{"turn": 1, "session": i, "ttft": t, "cached": cached, "prompt": prompt} for i, t in enumerate(ttfts)]
    return {**tier_sessions.summary(rows, ARGS), **more}


ARGS = Namespace(sessions=4, turns=2, user_tokens=160, answer_tokens=32, threads=1, quantization=None,
                 lengths=[1024])


def test_report_with_a_vllm_row_and_the_ratios() -> None:
    s = {"sizes": {"total": 1536, "longest": 384, "blocks": 32, "vllm_blocks": 17},
         "tier": fake([0.2, 0.3, 0.4, 0.5], 300, 352, hit_blocks=40.0, miss_blocks=5.0, words=[1]),
         "no_tier": fake([1.0, 1.0, 1.2, 1.4], 32, 352, hit_blocks=0.0, miss_blocks=0.0, words=[1]),
         "vllm": fake([0.9, 1.0, 1.1, 1.6], 64, 352, start_s=120.0, version="0.32.0",
                      model="ckpt in float32", ours_model="m.gguf")}
    table, result = tier.report(ARGS, {"sessions": s})
    # p90 interpolated between the 3rd and 4th of 4: 0.4 + 0.7 x 0.1 = 0.47, and 1.1 + 0.7 x 0.5 = 1.45
    assert s["tier"]["ttft_p50"] == pytest.approx(0.35) and s["tier"]["ttft_p90"] == pytest.approx(0.47)
    assert "| ours, with the tier | 350 ms | 470 ms | 85.2% | 40 | 5 |" in table
    assert "| vLLM CPU (recomputes) | 1050 ms | 1450 ms | 18.2% | - | - |" in table
    assert "**3.00x**" in table and "**3.09x**" in table                                    # 1.05 / 0.35, 1.45 / 0.47
    assert "**3.0x** the KV cache of 512 tokens" in table and "vLLM: 17 blocks of 32" in table
    assert result["sessions_vllm_over_tier_ttft_p50"] == 3.0 and result["sessions_vllm_over_tier_ttft_p90"] == 3.09
    assert result["sessions_vllm_ttft_p50_ms"] == 1050.0 and "sessions_vllm_absent" not in result
    assert len(tier.figure(ARGS, {"sessions": s}).axes[0].lines) == 3

    del s["vllm"]
    s["vllm_absent"] = "not configured (--vllm-python or PREFIXSERVE_PEER_VLLM)"
    table, result = tier.report(ARGS, {"sessions": s})
    assert "vLLM CPU (recomputes)" not in table and "vLLM: 17 blocks" not in table
    assert "vLLM CPU: not run (not configured (--vllm-python or PREFIXSERVE_PEER_VLLM))." in table
    assert result["sessions_vllm_absent"].startswith("not configured")
    assert "sessions_vllm_over_tier_ttft_p50" not in result


def test_p90_is_never_below_p50() -> None:
    # two turns after the first (the smoke run's 2 sessions x 2 turns): p90 was the smaller of the two
    v = fake([0.9, 0.5], 0, 100)
    assert v["ttft_p50"] == pytest.approx(0.7) and v["ttft_p90"] == pytest.approx(0.86)


def test_a_cache_smaller_than_one_history_is_refused_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        tier.main(["--skip", "restart", "--sessions", "2", "--turns", "2", "--user-tokens", "100",
                   "--answer-tokens", "28", "--session-blocks", "15"])              # 240 tokens < 256
    assert exc.value.code == 2
    assert "--session-blocks 15 holds 240 tokens, fewer than one session's final history (256)" in \
        capsys.readouterr().err


@pytest.mark.slow
def test_sessions_on_a_tiny_checkpoint_without_vllm(tiny_llama_dir: Path, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    if shutil.which("redis-server") is None:
        pytest.skip("no redis-server")
    monkeypatch.delenv("PREFIXSERVE_PEER_VLLM", raising=False)
    rc = cli.main(["tier", "--skip", "restart", "--model", str(tiny_llama_dir), "--sessions", "3", "--turns", "2",
                   "--user-tokens", "40", "--answer-tokens", "8", "--out", str(tmp_path)])
    assert rc == 0
    md = (tmp_path / "tier.md").read_text()
    assert "vLLM CPU: not run (not configured" in md and "| ours, without the tier |" in md
    saved = json.loads((tmp_path / "tier.json").read_text())
    raw = saved["raw"]["sessions"]
    assert raw["sizes"] == {"total": 288, "longest": 96, "blocks": 6, "vllm_blocks": 4}
    for name in ("tier", "no_tier"):             # every turn's prompt: the history so far + 40 new tokens
        assert [r["prompt"] for r in raw[name]["rows"]] == [40, 40, 40, 88, 88, 88]
