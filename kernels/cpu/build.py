"""Build the C++ CPU kernels, once, when the package is installed: every kernel for every named instruction-set
variant the compiler can target, into kernels/cpu/lib/<variant>/<kernel>.so, with a manifest. Standard library
only: setup.py loads this file by path (the build runs before torch can be imported), and `make kernels` /
`python kernels/cpu/build.py` run it on a source checkout.

    variant       compiler flags                               the CPU needs (its /proc/cpuinfo flags)
    portable      -march=x86-64 (any x86-64: SSE2)             nothing
    avx2          -march=x86-64-v3 (AVX2, FMA, F16C, BMI2)     avx2 fma f16c bmi2
    avx512        -march=x86-64-v4 (AVX-512 F/BW/CD/DQ/VL)     + avx512f avx512bw avx512cd avx512dq avx512vl
    avx512_vnni   + -mavx512vnni                               + avx512_vnni
    avx512_bf16   + -mavx512bf16 -mavx512vnni                  + avx512_bf16 avx512_vnni
    amx           + -mamx-tile -mamx-bf16 -mamx-int8           + amx_tile amx_bf16 amx_int8

On another architecture (aarch64, ...) only `portable` is built, with the compiler's default target. A variant
whose flags the compiler refuses (an old g++ without AMX) is left out and named in the manifest. Which variant
runs is decided when the kernels are loaded (kernels/cpu/library.py), from the CPU's flags: the best one the
CPU has, `portable` if none; never one it lacks.

A kernel is one C++ file beside this one (and the headers it includes) exporting `extern "C"` functions over
raw pointers: no torch headers, no Python bindings, loaded with ctypes. Flags besides the variant's: -O3,
-fno-math-errno (loops of expf may use the vector math library), -fopenmp (the process's OpenMP runtime is
torch's own libgomp, already loaded when the kernels are: their threads are torch's threads, and
`torch.set_num_threads` applies to them).

The compiler is $CXX, split as a shell would (`CXX="ccache g++"` works), else g++, else c++.
$PREFIXSERVE_CPU_VARIANTS (comma-separated names) builds only those, e.g. for a quick test build.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

SOURCES = Path(__file__).resolve().parent
KERNELS = ("paged_decode", "paged_prefill", "fused", "logits", "int4_gemm", "layers")
COMMON_FLAGS = ("-O3", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=c++17")
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...]                # compiler flags
    requires: frozenset[str]              # CPU flags (as /proc/cpuinfo names them) it needs to run


_V3 = frozenset({"avx", "avx2", "fma", "f16c", "bmi1", "bmi2", "movbe"})
_V4 = _V3 | {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"}
_VNNI = _V4 | {"avx512_vnni"}
_BF16 = _VNNI | {"avx512_bf16"}
X86_VARIANTS = (      # from the least to the most demanding
    Variant("portable", ("-march=x86-64", "-mtune=generic"), frozenset()),
    Variant("avx2", ("-march=x86-64-v3", "-mtune=generic"), _V3),
    Variant("avx512", ("-march=x86-64-v4", "-mtune=generic"), _V4),
    Variant("avx512_vnni", ("-march=x86-64-v4", "-mtune=generic", "-mavx512vnni"), _VNNI),
    Variant("avx512_bf16", ("-march=x86-64-v4", "-mtune=generic", "-mavx512bf16", "-mavx512vnni"), _BF16),
    Variant("amx", ("-march=x86-64-v4", "-mtune=generic", "-mavx512bf16", "-mavx512vnni", "-mamx-tile",
                    "-mamx-bf16", "-mamx-int8"), _BF16 | {"amx_tile", "amx_bf16", "amx_int8"}),
)
OTHER_VARIANTS = (Variant("portable", (), frozenset()),)


def variants(machine: str | None = None) -> tuple[Variant, ...]:
    """The variants for an architecture (this one by default), least demanding first."""
    m = (machine or platform.machine()).lower()
    return X86_VARIANTS if m in ("x86_64", "amd64") else OTHER_VARIANTS


def compiler() -> list[str] | None:
    """The C++ compiler as argv: $CXX split as a shell would, else g++ / c++ from PATH; None if there is none."""
    cxx = os.environ.get("CXX", "").strip()
    if cxx:
        return shlex.split(cxx)
    found = shutil.which("g++") or shutil.which("c++")
    return [found] if found else None


def source_digest() -> str:
    """Of every kernel source and header: a build from other sources is stale (kernels/cpu/library.py says so)."""
    h = hashlib.sha256()
    for f in sorted([*SOURCES.glob("*.cpp"), *SOURCES.glob("*.h")]):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    return h.hexdigest()[:16]


def _accepts(cxx: list[str], flags: tuple[str, ...]) -> bool:
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "probe.cpp"
        src.write_text("int prefixserve_probe() { return 0; }\n")
        out = subprocess.run([*cxx, *flags, *COMMON_FLAGS, str(src), "-o", str(Path(tmp) / "probe.so")],
                             capture_output=True, text=True, timeout=120)
        return out.returncode == 0


def _compile(cxx: list[str], variant: Variant, kernel: str, out_dir: Path) -> None:
    target = out_dir / variant.name / f"{kernel}.so"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".so.tmp")
    cmd = [*cxx, *variant.flags, *COMMON_FLAGS, str(SOURCES / f"{kernel}.cpp"), "-o", str(tmp)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if out.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise RuntimeError(f"building {kernel}.cpp for {variant.name} failed ({shlex.join(cmd)}):\n"
                           f"{out.stderr.strip()[-4000:]}")
    os.replace(tmp, target)


def build(out_dir: Path, only: list[str] | None = None, jobs: int | None = None, log=print,  # type: ignore[no-untyped-def]
          kernels: tuple[str, ...] = KERNELS) -> dict:  # type: ignore[type-arg]
    """Compiles every kernel (`kernels`) for every variant the compiler takes (`only`: those names) into out_dir;
    writes and returns the manifest. Raises RuntimeError without a compiler or when a kernel fails to build."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("no C++ compiler: set CXX or install g++ (the CPU kernels are built at install time)")
    wanted = [v for v in variants() if only is None or v.name in only]
    unknown = sorted(set(only or ()) - {v.name for v in variants()})
    if unknown:
        raise RuntimeError(f"unknown CPU kernel variants {unknown}; known: {[v.name for v in variants()]}")
    version = subprocess.run([*cxx, "--version"], capture_output=True, text=True).stdout.splitlines()[:1]
    built, refused = [], {}
    for v in wanted:
        if _accepts(cxx, v.flags):
            built.append(v)
        else:
            refused[v.name] = f"the compiler does not take {' '.join(v.flags)}"
            log(f"prefixserve kernels: {v.name} left out: {refused[v.name]}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / MANIFEST).unlink(missing_ok=True)          # no manifest while the libraries change
    for old in out_dir.iterdir():                          # variants of an earlier build that this one leaves out
        if old.is_dir() and old.name not in {v.name for v in built}:
            shutil.rmtree(old)
    jobs = jobs or max(1, min(8, os.cpu_count() or 1))
    with ThreadPoolExecutor(jobs) as pool:
        for f in [pool.submit(_compile, cxx, v, k, out_dir) for v in built for k in kernels]:
            f.result()
    manifest = {
        "sources": source_digest(),
        "compiler": shlex.join(cxx),
        "compiler_version": version[0] if version else "",
        "machine": platform.machine(),
        "variants": {v.name: {"flags": list(v.flags), "requires": sorted(v.requires)} for v in built},
        "left_out": refused,
        "kernels": list(kernels),
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    log(f"prefixserve kernels: built {', '.join(v.name for v in built)} with {manifest['compiler']} "
        f"into {out_dir}")
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Build the C++ CPU kernels for every instruction-set variant.")
    ap.add_argument("--out", type=Path, default=SOURCES / "lib", help="output folder (default: kernels/cpu/lib)")
    ap.add_argument("--variants", default=os.environ.get("PREFIXSERVE_CPU_VARIANTS"),
                    help="comma-separated variant names (default: every one the compiler takes)")
    ap.add_argument("--jobs", type=int, default=None)
    a = ap.parse_args(argv)
    only = [v.strip() for v in a.variants.split(",") if v.strip()] if a.variants else None
    try:
        build(a.out, only, a.jobs)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
