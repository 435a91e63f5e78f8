"""The engine's one door to compute: the op layer and the kernels behind it.

    ops                                 Ops: every op the engine calls, the implementation chosen once (CPU
                                        instruction set, device, batch-invariant mode); KernelReport says which
    quant_gemm                          the quantized GEMMs (torch's int4 / int8 kernels, oneDNN) and their packing
    cpu/                                C++ kernels built at install for named instruction sets, chosen at run time
    cpu_backend                         CPU attention on paged caches: the C++ kernels, torch's flash attention
    torch_backend, contiguous_torch     CPU: torch over block tables / over contiguous slot views
    triton_backend                      GPU: the Triton launchers behind the same protocols, both layouts
    paged_decode, paged_prefill, kv_write, block_copy     the Triton kernels (kernel + launcher each)
    metadata                            AttentionMetadata: the flattened batch every backend reads
    hugepages                           the serving process re-executed with glibc's transparent huge pages

No engine imports: the engine calls in, never the reverse. Which kernels read which cache is the KV
backend's choice (engine/kv/backends/<name>/__init__.py), not this package's. Importing this package
imports no torch (the engine's config reads kernels/cpu/build.py's variant names without it)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch

    from kernels.cpu.paged_decode import DecodePlan
    from kernels.metadata import AttentionMetadata


class Attention(Protocol):
    """Writes a step's new K/V into the cache and attends over it. Paged caches are [num_blocks,
    block_size, Hkv, D] read through md.block_tables; contiguous (vAttention) caches are [num_slots,
    slot_len, Hkv, D] read through md.slot_ids."""

    name: str

    def write_kv(self, key_cache: torch.Tensor, value_cache: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, md: AttentionMetadata) -> None: ...

    def forward(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                md: AttentionMetadata, scale: float) -> torch.Tensor: ...

    def attend(self, q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor,
               value_cache: torch.Tensor, md: AttentionMetadata, scale: float) -> torch.Tensor:
        """write_kv, then forward: what one layer of a step does (a backend may fuse the two)."""
        ...

    def decode_plan(self, md: AttentionMetadata, key_cache: torch.Tensor, num_heads: int,
                    head_dim: int) -> DecodePlan | None:
        """A decode-only step's plan for the C++ paged decode kernel, where `attend` would run that kernel on every
        layer of the step (the C++ decode layers take it: kernels/cpu/layers.py); None for every other backend
        and step."""
        ...


class AttentionBackend(Attention, Protocol):
    """Attention over a paged cache, and the paged cache's block copy (copy-on-write)."""

    def copy_blocks(self, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                    src: torch.Tensor, dst: torch.Tensor) -> None: ...


def __getattr__(name: str) -> Any:
    if name == "AttentionMetadata":
        from kernels.metadata import AttentionMetadata
        return AttentionMetadata
    raise AttributeError(name)


__all__ = ["AttentionBackend", "AttentionMetadata", "Attention"]
