"""The build step pyproject.toml leaves to code: the C++ CPU kernels, compiled for every instruction-set variant
(kernels/cpu/build.py) by `pip install` (wheel, sdist install and editable alike).

Why setuptools' build_ext and not scikit-build-core / CMake or torch.utils.cpp_extension: the kernels are five
plain C++ files with `extern "C"` entry points loaded through ctypes, with no Python or torch headers to find
and no link against libtorch (what cpp_extension is for), and no dependencies to configure (what CMake is for).
build_ext is the step pip already runs for every compiled package; declaring the libraries as one extension
makes the wheel platform-specific (it holds machine code) and makes editable installs build them in place.
"""
from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = Path(__file__).resolve().parent


def _kernel_build():  # type: ignore[no-untyped-def]
    """kernels/cpu/build.py, loaded by path: importing the `kernels` package would import torch."""
    spec = importlib.util.spec_from_file_location("prefixserve_kernel_build", ROOT / "kernels" / "cpu" / "build.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module               # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


class BuildCpuKernels(build_ext):
    """Builds kernels/cpu/lib/<variant>/<kernel>.so and its manifest, into the build tree (a wheel) or the
    source tree (editable installs, `--inplace`)."""

    def run(self) -> None:
        kb = _kernel_build()
        out = ROOT / "kernels" / "cpu" / "lib" if self.inplace or self.editable_mode else \
            Path(self.build_lib) / "kernels" / "cpu" / "lib"
        try:
            self._built = kb.build(out, only=self._only(), log=lambda m: print(m, flush=True))
        except RuntimeError as exc:
            raise SystemExit(f"prefixserve: {exc}") from exc
        self._out = out

    @staticmethod
    def _only() -> list[str] | None:
        names = os.environ.get("PREFIXSERVE_CPU_VARIANTS", "")
        return [n.strip() for n in names.split(",") if n.strip()] or None

    def get_outputs(self) -> list[str]:
        out = getattr(self, "_out", None)
        return [str(p) for p in sorted(out.rglob("*")) if p.is_file()] if out is not None else []

    def get_output_mapping(self) -> dict[str, str]:
        return {}


setup(
    ext_modules=[Extension("kernels.cpu.lib", sources=[])],     # stands for the libraries BuildCpuKernels makes
    cmdclass={"build_ext": BuildCpuKernels},
)
