"""Which build of the C++ CPU kernels this process runs, chosen from the CPU's flags, and loading it.

`pip install` built kernels/cpu/lib/<variant>/<kernel>.so for every variant the compiler took, with a manifest
(kernels/cpu/build.py). Nothing is compiled here: serving needs no compiler.

    cpu_flags()                        the CPU's feature flags, as /proc/cpuinfo names them
    choose(requested, flags, built)    "auto": the most demanding built variant whose flags the CPU has
                                       (portable needs none); a named one only if the CPU has its flags
    load(requested)                    that variant's four libraries, loaded once per process (ctypes)

A CPU the build did not target gets a variant it can run (portable at least), never one it lacks: forcing a
variant the CPU cannot run raises KernelUnavailable naming the missing flags, instead of dying of SIGILL in
the first kernel call. So does a build whose manifest says other sources than the ones beside it (a stale
editable install: `make kernels` rebuilds), or a missing build.
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import json
import logging
import platform
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kernels.cpu import amx_check
from kernels.cpu.build import KERNELS, MANIFEST, SOURCES, source_digest, variants
from kernels.cpu.fused import Fused
from kernels.cpu.int4_gemm import Int4Gemm
from kernels.cpu.layers import LayerHalves
from kernels.cpu.logits import Logits
from kernels.cpu.paged_decode import PagedDecode
from kernels.cpu.paged_prefill import VECTOR, PagedPrefill

log = logging.getLogger(__name__)
LIB_DIR = SOURCES / "lib"
CPUINFO = Path("/proc/cpuinfo")


class KernelUnavailable(RuntimeError):
    """The C++ kernels cannot run here: not built, built from other sources, or a variant this CPU lacks."""


def cpu_flags(cpuinfo: Path = CPUINFO) -> frozenset[str]:
    """The first processor's flags ("flags" on x86, "Features" on ARM); empty if there is no such file."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def choose(requested: str, flags: frozenset[str], built: list[str], machine: str | None = None) -> str:
    """The variant to run. Raises KernelUnavailable for a named variant not built or not runnable here."""
    known = {v.name: v for v in variants(machine)}
    if requested != "auto":
        if requested not in known:
            raise KernelUnavailable(f"unknown CPU kernel variant {requested!r}; known here: {sorted(known)}")
        missing = sorted(known[requested].requires - flags)
        if missing:
            raise KernelUnavailable(f"this CPU cannot run the {requested} kernels: it lacks {', '.join(missing)}")
        if requested not in built:
            raise KernelUnavailable(f"the {requested} kernels were not built (built: {', '.join(built) or 'none'})")
        return requested
    runnable = [v.name for v in variants(machine) if v.name in built and v.requires <= flags]
    if not runnable:
        raise KernelUnavailable(f"no built CPU kernel variant runs on this CPU (built: {', '.join(built) or 'none'})")
    return runnable[-1]


def manifest(directory: Path = LIB_DIR) -> dict:  # type: ignore[type-arg]
    """The build's manifest. Raises KernelUnavailable if there is no build, or one from other sources."""
    try:
        m = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError) as exc:
        raise KernelUnavailable(f"the C++ kernels are not built ({directory / MANIFEST}: {exc}); `pip install` "
                                "builds them (`make kernels` in a source checkout)") from exc
    if m.get("machine") != platform.machine():
        raise KernelUnavailable(f"the C++ kernels were built for {m.get('machine')}, this is {platform.machine()}")
    if sorted(m.get("kernels", [])) != sorted(KERNELS):
        raise KernelUnavailable(f"the C++ kernels build holds {m.get('kernels')}, not {list(KERNELS)}")
    if any(SOURCES.glob("*.cpp")) and m.get("sources") != source_digest():
        raise KernelUnavailable("the C++ kernels were built from other sources than the ones installed (an "
                                "editable install after an edit): `make kernels` rebuilds them")
    return m


@dataclass(frozen=True)
class CpuKernels:
    """One variant's libraries, loaded: the launchers the op layer calls."""

    variant: str
    compiler: str
    decode: PagedDecode
    prefill: PagedPrefill
    fused: Fused
    logits: Logits
    int4: Int4Gemm
    layers: LayerHalves                                       # the halves of gemm_bf16's steps (bfloat16 between)
    paths: dict[str, str] = field(default_factory=dict)      # kernel -> the loops it runs (avx2, avx512, ...)
    layers_f32: dict[str, LayerHalves] = field(default_factory=dict)   # those of gemm_q16's / gemm_wide's (float32)


@functools.cache
def load(requested: str = "auto", directory: Path = LIB_DIR) -> CpuKernels:
    """The kernels of the variant `choose` picks for this CPU (cached: a library is loaded once a process).
    Raises KernelUnavailable."""
    m = manifest(directory)
    variant = choose(requested, cpu_flags(), list(m.get("variants", {})))
    libs: dict[str, ctypes.CDLL] = {}
    for name in KERNELS:
        path = directory / variant / f"{name}.so"
        try:
            libs[name] = ctypes.CDLL(str(path))
        except OSError as exc:
            raise KernelUnavailable(f"loading {path} failed: {exc}") from exc
    decode, prefill = PagedDecode(libs["paged_decode"]), PagedPrefill(libs["paged_prefill"])
    fused, logits, int4 = Fused(libs["fused"]), Logits(libs["logits"]), Int4Gemm(libs["int4_gemm"])
    paths = {"paged_decode": decode.path, "paged_prefill": prefill.path(), "fused": fused.path, "logits": logits.path,
             "int4_gemm": int4.path}
    halves = {gemm: LayerHalves(libs["layers"], libs["int4_gemm"], libs["fused"], libs["paged_decode"], gemm)
              for gemm in LayerHalves.GEMMS}
    layers, layers_f32 = halves.pop("bf16"), halves
    return settle_amx_tiles(CpuKernels(variant, m.get("compiler_version") or m.get("compiler", ""), decode, prefill,
                                       fused, logits, int4, layers, paths, layers_f32))


def settle_amx_tiles(k: CpuKernels,
                     check: Callable[[PagedPrefill, PagedDecode], str | None] = amx_check.disagreement) -> CpuKernels:
    """A build whose attention takes AMX tiles keeps them if they pass their start check (kernels/cpu/amx_check.py:
    the same small prefill and cascade decode as the vector tiles, within the bf16 criterion); else it runs the
    vector tiles, says why in its paths, and warns."""
    if "amx" not in (k.paths.get("paged_prefill"), k.paths.get("paged_decode")):
        return k
    why = check(k.prefill, k.decode)
    if why is None:
        return k
    log.warning("the AMX attention tiles disagree with the vector tiles (%s): running the vector tiles", why)
    k.decode.set_tiles(VECTOR)
    off = f"avx512_bf16 (AMX tiles off: their start check failed: {why})"
    return dataclasses.replace(k, prefill=k.prefill.with_tiles(VECTOR),
                               paths={**k.paths, "paged_prefill": off, "paged_decode": off})


def built_variants(directory: Path = LIB_DIR) -> list[str]:
    try:
        return list(manifest(directory).get("variants", {}))
    except KernelUnavailable:
        return []


def runnable_variants(directory: Path = LIB_DIR) -> list[str]:
    """Built variants this CPU can run, least demanding first (tests run each)."""
    flags = cpu_flags()
    return [v.name for v in variants() if v.name in built_variants(directory) and v.requires <= flags]


__all__ = ["CpuKernels", "KernelUnavailable", "LIB_DIR", "choose", "cpu_flags", "load", "manifest",
           "runnable_variants", "settle_amx_tiles"]
