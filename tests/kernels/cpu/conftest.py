"""Fixtures of the C++ CPU kernels: `variant` runs a test once per build this CPU can run (portable, avx2, ...:
the dispatch forced to each in turn), `cpu` is the build the engine would choose here."""
from __future__ import annotations

import pytest

from kernels.cpu.library import CpuKernels, KernelUnavailable, load, runnable_variants

VARIANTS = runnable_variants()


@pytest.fixture(params=VARIANTS or [None], ids=lambda v: v or "none-built")
def variant(request: pytest.FixtureRequest) -> CpuKernels:
    if request.param is None:
        pytest.skip("no build of the C++ CPU kernels runs here (kernels/cpu/lib: make kernels)")
    return load(request.param)


@pytest.fixture
def cpu() -> CpuKernels:
    try:
        return load("auto")
    except KernelUnavailable as exc:
        pytest.skip(str(exc))
