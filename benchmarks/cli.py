"""`prefixserve bench <name> [--quick] [--model M] [--device D] [--out DIR]`: one entry point for every benchmark.

    prefixserve bench memory --quick
    prefixserve bench prefix --quick --out /tmp/results

Names: throughput, memory, prefix, sharing, structured, vattention, decode, threads, gemm (benchmarks/offline/: the
engine or its kernels in this process), routing, peers, isolation, fairness, tier (benchmarks/served/: servers
over HTTP); each <name>.md/.png/.json into --out and prints `RESULT {json}` last. Delegated, with options of
their own: serving (benchmarks/served/serving.py) and kernels (benchmarks/offline/kernels.py: the Triton kernels on
CUDA; `--device cpu`: the C++ CPU kernels).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import sys
from collections.abc import Iterator
from pathlib import Path

OFFLINE = ("throughput", "memory", "prefix", "sharing", "structured", "vattention", "decode", "threads", "kernels",
           "gemm")
SERVED = ("routing", "peers", "serving", "isolation", "fairness", "tier")
OURS = ("throughput", "memory", "prefix", "sharing", "structured", "routing", "vattention", "decode", "threads",
        "gemm", "peers", "isolation", "fairness", "tier")
DELEGATED = ("serving", "kernels")


def module_name(name: str) -> str:
    return f"benchmarks.{'offline' if name in OFFLINE else 'served'}.{name}"
PROG = "prefixserve bench"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ap = argparse.ArgumentParser(prog=PROG, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("name", choices=OURS + DELEGATED)
    ap.add_argument("args", nargs=argparse.REMAINDER, help="the benchmark's own options (--quick, --model, ...)")
    if not argv or argv[0] in ("-h", "--help"):
        ap.print_help()
        return 0 if argv else 2
    ns = ap.parse_args(argv[:1])
    rest = argv[1:]
    if ns.name in OURS:
        module = importlib.import_module(module_name(ns.name))
        return int(module.main(rest, prog=f"{PROG} {ns.name}"))
    return _delegate(ns.name, rest)


def _delegate(name: str, rest: list[str]) -> int:
    """Runs the benchmark's `main` (owned elsewhere): with argv if it takes one, else under a
    patched sys.argv. The common options it does not know (--out, --device) are taken off; --out then
    redirects its module-level RESULTS folder where it has one. A `sys.exit("message")` (kernels
    without CUDA) prints the message and returns 1, with no traceback."""
    try:
        module = importlib.import_module(module_name(name))
    except ModuleNotFoundError as exc:
        if exc.name != module_name(name):
            raise
        print(f"{PROG} {name}: {module_name(name)} does not exist yet", file=sys.stderr)
        return 1
    source = _source(module)
    for option in ("--out", "--device"):
        if option in rest and f'"{option}"' not in source:
            rest, value = _pop_option(rest, option)
            if option == "--out" and value is not None and hasattr(module, "RESULTS"):
                module.RESULTS = Path(value)  # type: ignore[attr-defined]
            else:
                print(f"{PROG} {name}: ignoring {option} {value} ({module_name(name)} has no such option)",
                      file=sys.stderr)
    try:
        if inspect.signature(module.main).parameters:
            rc = module.main(rest)
        else:
            with _argv([module_name(name), *rest]):
                rc = module.main()
    except SystemExit as exc:
        if isinstance(exc.code, str):
            print(exc.code, file=sys.stderr)
            return 1
        return int(exc.code or 0)
    return int(rc or 0)


def _source(module: object) -> str:
    try:
        return inspect.getsource(module)  # type: ignore[arg-type]
    except (OSError, TypeError):
        return ""


def _pop_option(rest: list[str], option: str) -> tuple[list[str], str | None]:
    i = rest.index(option)
    value = rest[i + 1] if i + 1 < len(rest) else None
    return rest[:i] + rest[i + 2:], value


@contextlib.contextmanager
def _argv(argv: list[str]) -> Iterator[None]:
    saved = sys.argv
    sys.argv = argv
    try:
        yield
    finally:
        sys.argv = saved


if __name__ == "__main__":
    raise SystemExit(main())
