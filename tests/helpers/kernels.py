"""The C++ CPU kernels for a test run from a source checkout: `pip install` builds them (setup.py), but a worktree
run with PYTHONPATH may have none, or a build from other sources. `ensure_built` builds the variants this CPU can
run into kernels/cpu/lib, once, under a lock (the test harness compiles; the server never does)."""
from __future__ import annotations

import fcntl

import pytest

from kernels.cpu import build
from kernels.cpu.library import LIB_DIR, KernelUnavailable, cpu_flags, manifest


def ensure_built() -> None:
    try:
        manifest()
        return
    except KernelUnavailable:
        pass
    if build.compiler() is None:
        return                      # the kernel tests skip, the engine runs its torch fallbacks
    LIB_DIR.mkdir(parents=True, exist_ok=True)
    with open(LIB_DIR / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            manifest()              # another process built them while this one waited
        except KernelUnavailable:
            flags = cpu_flags()
            build.build(LIB_DIR, only=[v.name for v in build.variants() if v.requires <= flags], log=lambda _m: None)


def pretend_amx(monkeypatch: pytest.MonkeyPatch) -> None:
    """The op layers made from here on choose as on a CPU with AMX (its flags added to this CPU's); the kernels stay
    this CPU's."""
    import kernels.ops as ops_module
    flags = ops_module.cpu_flags()
    monkeypatch.setattr(ops_module, "cpu_flags", lambda: flags | {"amx_tile", "amx_bf16", "amx_int8"})
