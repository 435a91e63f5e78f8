"""Which build of the C++ kernels runs: chosen from the CPU's flags, never one the CPU lacks (forcing one is
refused with the missing flags named, not a SIGILL), a missing or stale build refused with the fix named; the
build takes a compiler with arguments (`CXX="ccache g++"`); the engine reports what it chose and refuses to
start on a forced variant it cannot run."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from kernels.cpu import build
from kernels.cpu.library import LIB_DIR, KernelUnavailable, choose, cpu_flags, load, manifest, runnable_variants

ALL = [v.name for v in build.X86_VARIANTS]
AVX2_CPU = frozenset("fpu sse2 avx avx2 fma f16c bmi1 bmi2 movbe".split())        # Zen 3: no AVX-512
ZEN4 = AVX2_CPU | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16", "avx512_vnni"}
CASCADE_LAKE = ZEN4 - {"avx512_bf16"}                                             # AVX-512 VNNI, no BF16
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_bf16", "amx_int8"}


def test_auto_picks_the_best_variant_the_cpu_has() -> None:
    assert choose("auto", frozenset(), ALL, "x86_64") == "portable"             # a CPU the build did not target
    assert choose("auto", AVX2_CPU, ALL, "x86_64") == "avx2"
    assert choose("auto", ZEN4, ALL, "x86_64") == "avx512_bf16"
    assert choose("auto", CASCADE_LAKE, ALL, "x86_64") == "avx512_vnni"
    assert choose("auto", CASCADE_LAKE - {"avx512_vnni"}, ALL, "x86_64") == "avx512"        # Skylake-SP
    assert choose("auto", SAPPHIRE_RAPIDS, ALL, "x86_64") == "amx"
    assert choose("auto", SAPPHIRE_RAPIDS, ["portable", "avx2"], "x86_64") == "avx2"   # an older compiler's build
    assert choose("auto", AVX2_CPU - {"fma"}, ALL, "x86_64") == "portable"      # every flag of a variant, or not it
    assert choose("auto", frozenset({"asimd"}), ["portable"], "aarch64") == "portable"


def test_a_variant_the_cpu_lacks_is_refused_by_name() -> None:
    with pytest.raises(KernelUnavailable, match="cannot run the avx512 kernels: it lacks avx512bw, avx512cd"):
        choose("avx512", AVX2_CPU, ALL, "x86_64")
    with pytest.raises(KernelUnavailable, match="lacks amx_bf16, amx_int8, amx_tile"):
        choose("amx", ZEN4, ALL, "x86_64")
    with pytest.raises(KernelUnavailable, match="were not built"):
        choose("amx", SAPPHIRE_RAPIDS, ["portable", "avx2"], "x86_64")
    with pytest.raises(KernelUnavailable, match="unknown CPU kernel variant"):
        choose("sse9", AVX2_CPU, ALL, "x86_64")
    assert choose("portable", ZEN4, ALL, "x86_64") == "portable"                # any CPU may run the portable one


def test_cpu_flags_are_read_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\nflags\t\t: fpu avx2 fma\nbogomips\t: 1\n\n"
                    "processor\t: 1\nflags\t\t: fpu avx2 fma\n")
    assert cpu_flags(info) == {"fpu", "avx2", "fma"}
    assert cpu_flags(tmp_path / "none") == frozenset()
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd sve\n")
    assert cpu_flags(arm) == {"fp", "asimd", "sve"}


def test_this_cpu_runs_what_it_has_and_refuses_the_rest() -> None:
    runnable = runnable_variants()
    if not runnable:
        pytest.skip("no build of the C++ kernels here")
    assert runnable[0] == "portable" and load().variant == runnable[-1]
    flags = cpu_flags()
    lacking = [v for v in build.variants() if not v.requires <= flags]
    if not lacking:
        pytest.skip("this CPU has every variant's flags")
    with pytest.raises(KernelUnavailable, match=f"cannot run the {lacking[0].name} kernels"):
        load(lacking[0].name)


def copy_build(tmp_path: Path) -> Path:
    if not runnable_variants():
        pytest.skip("no build of the C++ kernels here")
    return Path(shutil.copytree(LIB_DIR, tmp_path / "lib", ignore=shutil.ignore_patterns(".lock")))


def test_a_missing_or_stale_build_is_refused(tmp_path: Path) -> None:
    lib = copy_build(tmp_path)
    assert manifest(lib)["sources"] == build.source_digest()
    m = json.loads((lib / "manifest.json").read_text())
    m["sources"] = "0" * 16                                  # built from other sources: an edit since
    (lib / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(KernelUnavailable, match="other sources.*make kernels"):
        load("auto", lib)
    (lib / "manifest.json").unlink()
    with pytest.raises(KernelUnavailable, match="not built"):
        load("auto", lib)


def test_the_build_takes_a_compiler_with_arguments(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CXX="ccache g++": a launcher, then the compiler (here a stand-in ccache that runs its arguments)."""
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++ here")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    launcher = bin_dir / "ccache"
    launcher.write_text('#!/bin/sh\necho "$@" >> "$(dirname "$0")/calls"\nexec "$@"\n')
    launcher.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("CXX", "ccache g++")
    assert build.compiler() == ["ccache", "g++"]
    m = build.build(tmp_path / "out", only=["portable"], kernels=("logits",), log=lambda _m: None)
    assert m["compiler"] == "ccache g++" and list(m["variants"]) == ["portable"]
    assert (tmp_path / "out" / "portable" / "logits.so").is_file()
    assert "logits.cpp" in (bin_dir / "calls").read_text()                 # it went through the launcher
    monkeypatch.setenv("CXX", "")
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    with pytest.raises(RuntimeError, match="no C.. compiler"):
        build.build(tmp_path / "none", only=["portable"], kernels=("logits",), log=lambda _m: None)


def test_the_engine_reports_its_choice_and_refuses_a_variant_it_cannot_run(tiny_llama_dir: Path,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    from engine import LLM
    from kernels.ops import KernelConfig, Ops

    runnable = runnable_variants()
    if not runnable:
        pytest.skip("no build of the C++ kernels here")
    with caplog.at_level("INFO", logger="engine.core"):
        llm = LLM(str(tiny_llama_dir), quantization="int4", num_kv_blocks=16)
    logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("kernels: ")]
    lacking = [v for v in build.variants() if not v.requires <= cpu_flags()]
    # on a CPU that runs every build (an AMX Xeon) there is no better one to name
    why = "the best build this CPU runs" if lacking else "the most demanding build, and this CPU has its flags"
    assert logged[0].startswith(f"kernels: C++ CPU kernels {runnable[-1]} ({why}")
    if lacking:                                                 # why not a better one: the flags it lacks
        assert f"{lacking[0].name} needs {', '.join(sorted(lacking[0].requires - cpu_flags()))}" in logged[0]
    assert any(m.startswith(f"kernels: paged decode: c++ {runnable[-1]}") for m in logged)
    report = llm.engine.core.ops.report
    assert report.cpu_variant == runnable[-1] and why in report.cpu_reason
    assert report.ops["paged decode"].startswith(f"c++ {runnable[-1]}")
    off = Ops(KernelConfig(cpu_kernels="none")).report
    assert off.cpu_variant is None and "turned off" in off.cpu_reason and off.ops["paged decode"] == "torch"
    assert off.lines()[0] == "no C++ CPU kernels: turned off (cpu_kernels none)"
    lacking = [v.name for v in build.variants() if not v.requires <= cpu_flags()]
    if lacking:
        with pytest.raises(KernelUnavailable, match=f"cannot run the {lacking[0]} kernels"):
            LLM(str(tiny_llama_dir), quantization="int4", num_kv_blocks=16, cpu_kernels=lacking[0])
