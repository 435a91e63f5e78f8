"""The serving process's huge pages (kernels/hugepages.py): when it re-executes itself with glibc's tunable, and
that a process started so gets its big allocations backed by transparent huge pages."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kernels import hugepages
from kernels.hugepages import HUGETLB, SWITCH, TUNABLES, reexec_environment


def test_reexec_only_where_it_helps() -> None:
    base = {"PATH": "/bin"}
    assert reexec_environment(base, "madvise", (2, 36)) == {"PATH": "/bin", TUNABLES: HUGETLB}
    assert reexec_environment({**base, TUNABLES: "glibc.malloc.arena_max=2"}, "madvise", (2, 35)) == \
        {"PATH": "/bin", TUNABLES: f"glibc.malloc.arena_max=2:{HUGETLB}"}          # other tunables kept
    assert reexec_environment({**base, TUNABLES: HUGETLB}, "madvise", (2, 36)) is None     # once: no loop
    assert reexec_environment({**base, TUNABLES: "glibc.malloc.hugetlb=0"}, "madvise", (2, 36)) is None
    assert reexec_environment(base, "always", (2, 36)) is None                   # every page huge already
    assert reexec_environment(base, "never", (2, 36)) is None
    assert reexec_environment(base, "", (2, 36)) is None                         # no THP (or not Linux)
    assert reexec_environment(base, "madvise", (2, 34)) is None                  # glibc without the tunable
    assert reexec_environment(base, "madvise", None) is None                     # not glibc
    assert reexec_environment({**base, SWITCH: "0"}, "madvise", (2, 36)) is None


def test_thp_mode_reads_the_bracketed_choice(tmp_path: Path) -> None:
    f = tmp_path / "enabled"
    f.write_text("always [madvise] never\n")
    assert hugepages.thp_mode(f) == "madvise"
    assert hugepages.thp_mode(tmp_path / "missing") == ""


def _huge_kib(script: str, env: dict[str, str]) -> int:
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return int(out.stdout.split()[-1])


def test_a_reexecuted_process_gets_huge_pages_for_big_tensors() -> None:
    """The real thing: a child calls maybe_reexec, allocates a 256 MiB tensor and counts AnonHugePages in its own
    smaps; without the re-exec (PREFIXSERVE_HUGE_PAGES=0) the same child gets none."""
    if hugepages.thp_mode() != "madvise" or (hugepages.glibc_version() or (0, 0)) < (2, 35):
        pytest.skip(f"THP {hugepages.thp_mode()!r}, glibc {hugepages.glibc_version()}: nothing to re-execute for")
    script = textwrap.dedent("""
        from kernels import hugepages
        hugepages.maybe_reexec()
        import torch
        t = torch.ones(64 << 20)          # 256 MiB, touched
        kib = 0
        for line in open("/proc/self/smaps"):
            if line.startswith("AnonHugePages:"):
                kib += int(line.split()[1])
        print(kib)
    """)
    env = {k: v for k, v in os.environ.items() if k != TUNABLES}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    assert _huge_kib(script, {**env, SWITCH: "1"}) >= 128 * 1024
    assert _huge_kib(script, {**env, SWITCH: "0"}) < 16 * 1024
