"""The engine image (Dockerfile): its stages checked on the file (no Docker engine here), and its Python
environment built the same way without Docker: the package built as a wheel (the builder stage: a compiler),
installed into a fresh site folder (the runtime stage), then imported by a Python with no compiler on PATH and no
cache: it loads the C++ kernels the wheel carries and runs one."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def stages() -> list[list[str]]:
    """The Dockerfile's instructions, stage by stage (continuation lines joined)."""
    text = re.sub(r"\\\n\s*", " ", (ROOT / "Dockerfile").read_text())
    out: list[list[str]] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if line.startswith("FROM "):
            out.append([])
        out[-1].append(line)
    return out


def test_the_dockerfile_builds_in_one_stage_and_runs_in_another() -> None:
    builder, runtime = stages()
    assert builder[0] == "FROM python:3.11-slim AS builder"
    assert any(i.startswith("RUN apt-get") and " g++" in i for i in builder)           # the compiler, here only
    assert "RUN pip wheel --no-deps --wheel-dir /wheels ." in builder
    copied = {i.split()[-1].rstrip("/").lstrip("./") for i in builder if i.startswith("COPY ")}
    for needed in ("engine", "kernels", "service", "prefix_store"):
        assert needed in copied, needed
    assert any("setup.py" in i and "MANIFEST.in" in i and "pyproject.toml" in i
               for i in builder if i.startswith("COPY"))
    assert runtime[0] == "FROM python:3.11-slim"
    assert not any("g++" in i or "gcc" in i or "build-essential" in i for i in runtime)   # no compiler at run time
    assert "COPY --from=builder /wheels /wheels" in runtime
    assert any(i.startswith("RUN pip install /wheels/*.whl") for i in runtime)
    assert not any(i.startswith("COPY") and "--from" not in i for i in runtime)          # nothing else from the host
    assert runtime[-1].startswith('CMD ["prefixserve", "serve"')
    ignored = (ROOT / ".dockerignore").read_text().split()
    assert "kernels/cpu/lib" in ignored                     # the host's own build never reaches the image


@pytest.mark.timeout(600)
def test_the_images_python_loads_the_kernels_without_a_compiler(tmp_path: Path) -> None:
    if shutil.which("g++") is None:
        pytest.skip("no compiler to build the wheel with")
    env = dict(os.environ, PREFIXSERVE_CPU_VARIANTS="portable", PIP_NO_INDEX="1")       # one variant: quick
    src = tmp_path / "src"                               # a clean copy, as the builder stage's COPY lines make
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", ".venv*", "__pycache__", "lib", "*.egg-info",
                                                             "build", "tests", "benchmarks", ".*cache"))
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "--wheel-dir", str(wheels), str(src)], check=True, env=env, timeout=540)
    (wheel,) = wheels.glob("prefixserve-*.whl")
    assert not wheel.name.endswith("-none-any.whl")      # machine code inside: a platform wheel
    names = zipfile.ZipFile(wheel).namelist()
    assert "kernels/cpu/lib/manifest.json" in names and "kernels/cpu/lib/portable/paged_decode.so" in names
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, env=env, timeout=120)
    probe = (
        "import shutil, torch, kernels.cpu.library as L\n"
        "assert shutil.which('g++') is None and shutil.which('c++') is None\n"
        "k = L.load()\n"
        "assert L.LIB_DIR.is_relative_to(r'SITE'), L.LIB_DIR\n"
        "q = torch.randn(2, 4, 64); kc = torch.randn(8, 16, 2, 64).bfloat16(); vc = torch.randn_like(kc)\n"
        "out = k.decode.decode(q, kc, vc, torch.tensor([[0, 1], [2, 3]], dtype=torch.int32),\n"
        "                      torch.tensor([20, 5], dtype=torch.int32), 0.125)\n"
        "assert torch.isfinite(out).all()\n"
        "print(k.variant, k.paths['paged_decode'])\n").replace("SITE", str(site))
    site_packages = [p for p in sys.path if p.endswith("site-packages")]     # torch and the other dependencies
    run_env = {"PATH": str(tmp_path / "no-compiler"), "HOME": str(tmp_path / "home"),
               "PYTHONPATH": os.pathsep.join([str(site), *site_packages])}
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=run_env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["portable", "generic"]
