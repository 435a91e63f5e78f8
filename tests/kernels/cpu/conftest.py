"""Fixtures of the C++ CPU kernels: `variant` runs a test once per build this CPU can run (portable, avx2, ...:
the dispatch forced to each in turn), `cpu` is the build the engine would choose here. BF16_BUILDS: those whose
attention takes bf16 products (the ones that can run the AMX tiles, emulated where the CPU has no AMX)."""
from __future__ import annotations

import dataclasses

import pytest

from kernels.cpu.library import CpuKernels, KernelUnavailable, load, runnable_variants
from kernels.cpu.paged_prefill import AMX, BF16_PATHS

VARIANTS = runnable_variants()
BF16_BUILDS = [v for v in VARIANTS if load(v).decode.path in BF16_PATHS]


def kernels_of(param: str | None) -> CpuKernels:
    """A `variant` parameter's kernels: a build by name, `<build>+amx_tiles` that build with its prefill forced to
    the AMX tiles; None (nothing built) skips."""
    if param is None:
        pytest.skip("no build of the C++ CPU kernels runs here (kernels/cpu/lib: make kernels)")
    name, _, tiles = param.partition("+")
    k = load(name)
    return dataclasses.replace(k, prefill=k.prefill.with_tiles(AMX)) if tiles else k


@pytest.fixture(params=VARIANTS or [None], ids=lambda v: v or "none-built")
def variant(request: pytest.FixtureRequest) -> CpuKernels:
    return kernels_of(request.param)


@pytest.fixture
def cpu() -> CpuKernels:
    try:
        return load("auto")
    except KernelUnavailable as exc:
        pytest.skip(str(exc))
