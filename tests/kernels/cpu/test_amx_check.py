"""The AMX tiles' start check (kernels/cpu/amx_check.py) and what a build does with its verdict
(kernels/cpu/library.py settle_amx_tiles): on a build with AVX-512 BF16 the check runs the emulated AMX tiles (the
real ones on an AMX build) against the vector tiles, and a disagreement turns the AMX tiles off."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels.cpu import amx_check
from kernels.cpu.library import CpuKernels, load, runnable_variants, settle_amx_tiles
from kernels.cpu.paged_prefill import AMX, BEST, VECTOR
from tests.kernels.cpu.conftest import BF16_BUILDS


@pytest.fixture
def bf16() -> CpuKernels:
    if not BF16_BUILDS:
        pytest.skip("no build with bf16 products runs here")
    return load(BF16_BUILDS[-1])


def test_the_amx_tiles_pass_their_check(bf16: CpuKernels) -> None:
    """They ran (not the vector tiles' bits) and agree within the bf16 criterion, in both kernels."""
    for error in (amx_check.prefill_error(bf16.prefill), amx_check.decode_error(bf16.decode)):
        assert 0 < error <= amx_check.TOLERANCE
    assert amx_check.disagreement(bf16.prefill, bf16.decode) is None


class WrongTiles:
    """A prefill launcher whose AMX tiles answer wrongly (a misread layout, say): the check must catch it."""

    def __init__(self, real):  # type: ignore[no-untyped-def]
        self.real, self.tiles = real, BEST

    def with_tiles(self, tiles: int) -> WrongTiles:
        w = WrongTiles(self.real)
        w.tiles = tiles
        return w

    def prefill(self, q, kc, vc, tables, lens, starts, seqs, scale, out):  # type: ignore[no-untyped-def]
        res = self.real.with_tiles(VECTOR).prefill(q, kc, vc, tables, lens, starts, seqs, scale, out)
        if self.tiles == AMX:
            out[:, :, :16] = out[:, :, 16:32].clone()           # one block of 16 dimensions from the wrong place
        return res


def test_a_wrong_answer_fails_the_check(bf16: CpuKernels) -> None:
    why = amx_check.disagreement(WrongTiles(bf16.prefill), bf16.decode)  # type: ignore[arg-type]
    assert why is not None and why.startswith("prefill ") and "decode" not in why


def test_a_failed_check_turns_the_amx_tiles_off(bf16: CpuKernels) -> None:
    as_amx = dataclasses.replace(bf16, paths={**bf16.paths, "paged_prefill": "amx", "paged_decode": "amx"})
    assert settle_amx_tiles(as_amx, check=lambda p, d: None) is as_amx        # passed: kept as it is
    with bf16.decode.forced_tiles(AMX):
        settled = settle_amx_tiles(as_amx, check=lambda p, d: "prefill 0.4 of the largest |V|")
        assert bf16.decode.set_tiles(AMX) == VECTOR                           # the decode kernel's tiles: vector
        assert settled.prefill.tiles == VECTOR and settled.prefill.path(torch.bfloat16) == "avx512_bf16"
        assert "AMX tiles off" in settled.paths["paged_prefill"] and "0.4" in settled.paths["paged_decode"]


def test_a_build_without_amx_tiles_is_not_checked(bf16: CpuKernels) -> None:
    def boom(p, d):  # type: ignore[no-untyped-def]
        raise AssertionError("checked")
    if bf16.paths["paged_prefill"] != "amx":
        assert settle_amx_tiles(bf16, check=boom) is bf16


def test_the_check_runs_on_cpu_tensors_inside_a_meta_device_block() -> None:
    """The first load of the kernels (and so the check) can come while a model is built on the meta device: the
    check's tensors must still be CPU tensors. Before, the kernels got meta tensors' null pointers and the process
    died (SIGSEGV: the CUDA engine's model construction on the first AMX CPU). In a child process, so that the old
    behaviour fails this test instead of killing the run."""
    import subprocess
    import sys

    if not runnable_variants():
        pytest.skip("no build of the C++ kernels runs here")
    code = ("import torch\nfrom kernels.cpu import amx_check\nfrom kernels.cpu.library import load\nk = load()\n"
            "with torch.device('meta'):\n    print('verdict', amx_check.disagreement(k.prefill, k.decode))\n")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "verdict" in run.stdout
