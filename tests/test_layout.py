"""The house rules, checked on the source: imports point one way, benchmarks stay out of the install and
the image, no folder outgrows a concern, and the core and the service never name a KV backend."""
from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("engine", "kernels", "service", "prefix_store")


def imports_of(path: Path) -> set[str]:
    """Every module a file imports (top-level names of `import x.y` and `from x.y import z` -> x.y)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.add(node.module)
    return out


def files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


# package -> top-level modules it must never import
FORBIDDEN = {
    "kernels": {"engine", "service", "prefix_store", "benchmarks", "cli"},
    "engine": {"service", "prefix_store", "benchmarks", "cli", "aiohttp", "redis"},
    "prefix_store": {"engine", "service", "benchmarks", "cli", "torch", "aiohttp"},
    "service": {"benchmarks"},
}


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_imports_point_one_way(package: str) -> None:
    bad = [(str(f.relative_to(ROOT)), m) for f in files(package) for m in imports_of(f)
           if m.split(".")[0] in FORBIDDEN[package]]
    # service/__main__.py is the `python -m service` entry script: it hands over to the CLI above it
    bad = [(f, m) for f, m in bad if not (f == "service/__main__.py" and m == "cli")]
    assert not bad, bad


def test_only_the_cli_imports_benchmarks() -> None:
    users = [str(f.relative_to(ROOT)) for p in (*PACKAGES, "cli.py") for f in
             ([ROOT / p] if p.endswith(".py") else files(p)) if any(m.split(".")[0] == "benchmarks"
                                                                 for m in imports_of(f))]
    assert users == ["cli.py"]


def test_the_service_uses_the_engine_through_its_public_faces() -> None:
    """The service imports the engine's boundary (config, errors, sequence, outputs, the async engine and its
    streams) and what requests are made of (structured specs), never its internals (core, scheduler, KV, worker)."""
    allowed = {"engine.config", "engine.errors", "engine.sequence", "engine.outputs", "engine.async_engine",
               "engine.request_stream", "engine.sample.structured"}
    bad = [(str(f.relative_to(ROOT)), m) for f in files("service") for m in imports_of(f)
           if m.startswith("engine") and m not in allowed]
    assert not bad, bad


def test_no_kv_backend_is_named_by_the_core_or_the_service() -> None:
    hits = subprocess.run(["grep", "-rn", "vattention", "engine/core.py", "service/"], cwd=ROOT,
                          capture_output=True, text=True).stdout
    assert hits == ""


def test_no_folder_holds_more_than_a_dozen_modules() -> None:
    for package in (*PACKAGES, "benchmarks", "tests"):
        for folder in [ROOT / package, *(p for p in (ROOT / package).rglob("*") if p.is_dir())]:
            if "__pycache__" in folder.parts:
                continue
            modules = [f for f in folder.glob("*.py") if f.name != "__init__.py"]
            assert len(modules) <= 12, (str(folder.relative_to(ROOT)), len(modules))


def test_benchmarks_are_not_installed_nor_in_the_image() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    assert not any(p.startswith("benchmarks") for p in include), include
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "benchmarks" not in dockerfile and "COPY engine" in dockerfile
    # the installed environment cannot import them from anywhere but the checkout
    out = subprocess.run([sys.executable, "-c", "import benchmarks"], cwd="/", capture_output=True, text=True)
    assert out.returncode != 0 and "No module named 'benchmarks'" in out.stderr


def test_the_engine_config_imports_no_torch() -> None:
    """The CLI builds its flags from EngineConfig (service/flags.py): `prefixserve --help` and a config error must
    not wait for torch to load. Also why QUANTIZATIONS lives in engine/config.py, not beside the layers."""
    code = "import sys, engine.config; assert 'torch' not in sys.modules, sorted(sys.modules)"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)


def test_every_package_says_what_its_modules_hold() -> None:
    for package in PACKAGES:
        for init in (ROOT / package).rglob("__init__.py"):
            doc = ast.get_docstring(ast.parse(init.read_text()))
            assert doc, f"{init.relative_to(ROOT)} has no docstring"


def test_no_import_cycles_in_the_engine_the_kernels_and_the_prefix_store() -> None:
    """Modules of engine/, kernels/ and prefix_store/ import each other without a cycle (function-level and
    TYPE_CHECKING imports included: a late import only hides one)."""
    def name(path: Path) -> str:
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name(f): f for package in ("engine", "kernels", "prefix_store") for f in files(package)}
    graph: dict[str, set[str]] = {}
    for mod, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                deps |= {m for m in [node.module, *(f"{node.module}.{a.name}" for a in node.names)] if m in modules}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name in modules}
        graph[mod] = deps - {mod}
    done: set[str] = set()

    def visit(mod: str, path: list[str]) -> None:
        if mod in path:
            raise AssertionError(" -> ".join(path[path.index(mod):] + [mod]))
        if mod in done:
            return
        for dep in sorted(graph[mod]):
            visit(dep, path + [mod])
        done.add(mod)

    for mod in sorted(graph):
        visit(mod, [])
