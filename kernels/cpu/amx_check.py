"""The AMX tiles' start check (kernels/cpu/library.py runs it when a build's attention takes AMX tiles): one small
prefill and one cascade decode, each with the AMX tiles and again with the vector tiles, on random data; they
must agree within the bf16 criterion (0.5% of the largest |V|; they differ only in the order of the float32 sums).

Why: the tests check the AMX tiles' logic through an emulation of the instructions' documented semantics
(kernels/cpu/amx_tile.h), which shares the kernel's reading of that documentation; the vector tiles do not. A
misreading would show here, on the first AMX CPU, as a disagreement, and the process then keeps the vector tiles
(with a warning naming the error) instead of serving wrong attention.
"""
from __future__ import annotations

import torch

from kernels.cpu.paged_decode import PagedDecode
from kernels.cpu.paged_prefill import AMX, VECTOR, PagedPrefill

TOLERANCE = 5e-3        # of the largest |V|: the bf16 tiles' criterion (kernels/cpu/paged_prefill.py)
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 64, 16


def _cache(blocks: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (blocks, BLOCK, KV_HEADS, HEAD_DIM)
    return (torch.randn(shape, generator=g).to(torch.bfloat16), torch.randn(shape, generator=g).to(torch.bfloat16))


def _error(a: torch.Tensor, b: torch.Tensor, v: torch.Tensor) -> float:
    return (a - b).abs().max().item() / v.float().abs().max().item()


def prefill_error(prefill: PagedPrefill) -> float:
    """AMX against vector tiles: a 70-token prompt after 30 cached tokens (rows in blocks of 16 cut mid-block, a
    tile cut mid-way), as a share of the largest |V|."""
    g = torch.Generator().manual_seed(0)
    kc, vc = _cache(7, g)
    tables = torch.arange(7, dtype=torch.int32)[None]
    lens, starts = torch.tensor([100], dtype=torch.int32), torch.tensor([0, 70], dtype=torch.int32)
    q = torch.randn(70, HEADS, HEAD_DIM, generator=g)
    outs = []
    for tiles in (AMX, VECTOR):
        out = torch.zeros_like(q)
        if prefill.with_tiles(tiles).prefill(q, kc, vc, tables, lens, starts, [0], HEAD_DIM ** -0.5, out) is None:
            return float("inf")          # declined: cannot vouch for the tiles
        outs.append(out)
    return _error(outs[0], outs[1], vc)


def decode_error(decode: PagedDecode) -> float:
    """AMX against vector tiles: 8 sequences (24 query rows a KV head) sharing 4 blocks, each with a block of its
    own, one cascade item, as a share of the largest |V|."""
    g = torch.Generator().manual_seed(1)
    kc, vc = _cache(12, g)
    tables = torch.tensor([[0, 1, 2, 3, 4 + s] for s in range(8)], dtype=torch.int32)
    lens = torch.tensor([4 * BLOCK + 3 + s for s in range(8)], dtype=torch.int32)
    q = torch.randn(8, HEADS, HEAD_DIM, generator=g)
    outs = []
    for tiles in (AMX, VECTOR):
        with decode.forced_tiles(tiles):
            outs.append(decode.decode(q, kc, vc, tables, lens, HEAD_DIM ** -0.5))
    return _error(outs[0], outs[1], vc)


def disagreement(prefill: PagedPrefill, decode: PagedDecode) -> str | None:
    """None where the AMX tiles agree with the vector tiles in both kernels, else what disagreed.

    NOTE: its tensors are made on the CPU whatever the caller's default device: the first load of the kernels may
    come inside a `torch.device("meta")` block (a model built on the meta device), whose meta tensors would hand the
    C++ kernels null pointers (a segfault, seen on the first AMX CPU this check ran on)."""
    with torch.device("cpu"):
        errors = {"prefill": prefill_error(prefill), "decode": decode_error(decode)}
    bad = {k: e for k, e in errors.items() if not e <= TOLERANCE}         # NaN counts as a disagreement
    if not bad:
        return None
    return ", ".join(f"{k} {e:.3g} of the largest |V|" for k, e in bad.items()) + f" (criterion {TOLERANCE})"


__all__ = ["TOLERANCE", "decode_error", "disagreement", "prefill_error"]
