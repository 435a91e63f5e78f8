"""Build and load the C++ CPU kernels: compiled once per machine with the system's C++ compiler, cached,
loaded with ctypes.

A kernel is one C++ file next to this module (and the headers beside it) exporting `extern "C"` functions
over raw pointers, so it needs no torch headers (it builds in about a second) and no Python bindings. The
build is keyed by the source and the headers, the compiler and the flags: `-O3 -march=native` targets
the CPU it runs on (AVX-512 where there is one; the sources keep a portable path for CPUs without),
`-fno-math-errno` lets loops of expf use the vector math library, `-fopenmp` shares torch's OpenMP runtime
(the same libgomp is already loaded, so the kernels' threads are torch's threads: `torch.set_num_threads`
applies to them). The library lands in $XDG_CACHE_HOME/prefixserve/kernels (else ~/.cache/...), written to a
temporary name and renamed, so concurrent builds never see a half-written file.

No compiler (or a failed build) raises KernelUnavailable; callers fall back to their torch path.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=c++17")
_SOURCES = Path(__file__).resolve().parent
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL] = {}


class KernelUnavailable(RuntimeError):
    """The C++ kernels cannot be built or loaded here (no compiler, a failed build)."""


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "prefixserve" / "kernels"


def load(name: str) -> ctypes.CDLL:
    """The library built from `<name>.cpp` (built on first use, then read from the cache)."""
    with _lock:
        if name in _loaded:
            return _loaded[name]
        cxx = compiler()
        if cxx is None:
            raise KernelUnavailable("no C++ compiler (g++) found; the CPU kernels cannot be built")
        source = (_SOURCES / f"{name}.cpp").read_bytes()
        source += b"".join(h.read_bytes() for h in sorted(_SOURCES.glob("*.h")))     # the headers it may include
        key = hashlib.sha256(source + cxx.encode() + " ".join(FLAGS).encode()).hexdigest()[:16]
        lib = cache_dir() / f"{name}-{key}.so"
        if not lib.exists():
            lib.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(suffix=".so", dir=lib.parent)
            os.close(fd)
            try:
                out = subprocess.run([cxx, *FLAGS, str(_SOURCES / f"{name}.cpp"), "-o", tmp], capture_output=True,
                                     text=True, timeout=300)
                if out.returncode != 0:
                    raise KernelUnavailable(f"building {name}.cpp failed: {out.stderr.strip()[-2000:]}")
                os.replace(tmp, lib)
            finally:
                if os.path.exists(tmp):
                    os.unlink(tmp)
        try:
            _loaded[name] = ctypes.CDLL(str(lib))
        except OSError as exc:
            raise KernelUnavailable(f"loading {lib} failed: {exc}") from exc
        return _loaded[name]


def available(name: str) -> bool:
    try:
        load(name)
    except KernelUnavailable:
        return False
    return True
