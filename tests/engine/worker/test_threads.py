"""The thread governor (engine/worker/threads.py): fewer compute threads while other processes want the same
cores, one more when they leave. Its policy against a scripted machine, then the real thing: an engine with
2 threads beside two spinning processes drops to one."""
from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest
import torch

from engine import LLM, SamplingParams
from engine.worker import threads as governor_mod
from engine.worker.threads import ThreadGovernor, read_idle, read_schedstat


class Machine:
    """A scripted 2-core CPU: each `advance` the process runs `dt` seconds a thread (waiting as measured beside a
    spinner, or alone), and the cores neither it nor the neighbour use are idle."""

    def __init__(self) -> None:
        self.now = 0.0
        self.run = self.wait = 0
        self.idle = 0.0
        self.threads = 2
        self.neighbour = False

    def advance(self, dt: float, busy: bool = True) -> None:
        self.now += dt
        used = (self.threads if busy else 0) + self.neighbour
        self.idle += dt * max(0, 2 - used)
        if busy:
            ran = dt * self.threads
            ratio = (1.5 if self.threads > 1 else 0.15) if self.neighbour else 0.02
            self.run += int(ran * 1e9)
            self.wait += int(ran * ratio * 1e9)

    def set(self, n: int) -> None:
        self.threads = n


def run_for(m: Machine, g: ThreadGovernor, seconds: float, busy: bool = True) -> list[int]:
    seen = []
    for _ in range(int(seconds / 0.1)):
        m.advance(0.1, busy)
        g.tick()
        seen.append(m.threads)
    return seen


def governor(m: Machine, idle: bool = True) -> ThreadGovernor:
    return ThreadGovernor(2, m.set, read=lambda: (m.run, m.wait), idle=(lambda: m.idle) if idle else None,
                          clock=lambda: m.now)


def test_a_neighbour_costs_a_window_coming_and_going() -> None:
    m = Machine()
    g = governor(m)
    assert run_for(m, g, 10) == [2] * 100                      # alone: no reason to change
    m.neighbour = True
    seen = run_for(m, g, 60)
    assert seen.index(1) <= 6 and seen[6:] == [1] * (len(seen) - 6)    # down within about a window, no probes:
    m.neighbour = False                                                 # no core was free
    seen = run_for(m, g, 10)
    assert seen.index(2) <= 11 and seen[-1] == 2 and g.changes == 2     # a core free: back within about two


def test_without_idle_times_probes_back_off() -> None:
    m = Machine()
    g = governor(m, idle=False)
    assert run_for(m, g, 10) == [2] * 100                      # alone: no reason to change
    m.neighbour = True
    seen = run_for(m, g, 1.0)
    assert seen[-1] == 1 and seen.index(1) <= 6                 # down within about a window
    seen = run_for(m, g, 60)
    up = [i for i in range(1, len(seen)) if seen[i] == 2 and seen[i - 1] == 1]
    gaps = [b - a for a, b in zip(up, up[1:])]
    assert len(up) >= 3 and all(b > a for a, b in zip(gaps, gaps[1:])), up     # each failed probe waits longer
    assert seen.count(2) < 0.1 * len(seen)                      # a probe lasts a window
    m.neighbour = False
    seen = run_for(m, g, 70)
    assert seen[-200:] == [2] * 200 and g.changes >= 2 * len(up)  # the neighbour left: back to 2, and it stays


def test_idle_windows_are_not_judged() -> None:
    m = Machine()
    g = governor(m)
    m.neighbour = True
    assert run_for(m, g, 30, busy=False) == [2] * 300          # nothing ran: nothing to judge
    m.advance(0.04)
    g.tick()                                                    # one short burst, under MIN_RUN_S a window
    assert m.threads == 2


def test_off_where_the_count_is_not_ours() -> None:
    assert ThreadGovernor.make(None, False, torch.set_num_threads) is None     # torch's default (offline LLM())
    assert ThreadGovernor.make(1, False, torch.set_num_threads) is None
    assert ThreadGovernor.make(2, True, torch.set_num_threads) is None         # batch-invariant
    assert ThreadGovernor.make(2, False, torch.set_num_threads) is not None


def test_schedstat_counts_this_process_running() -> None:
    run0, wait0 = read_schedstat()
    t = time.process_time()
    while time.process_time() - t < 0.2:
        pass
    run1, wait1 = read_schedstat()
    assert run1 - run0 >= 0.15e9 and wait1 >= wait0


def test_idle_counts_only_our_cores() -> None:
    idle0, t = read_idle(), time.monotonic()
    time.sleep(0.3)
    idle1, dt = read_idle(), time.monotonic() - t
    assert 0 <= idle1 - idle0 <= dt * len(os.sched_getaffinity(0)) + 0.05
    assert read_idle(frozenset()) == 0.0


def spin(stop: object) -> None:
    while not stop.is_set():        # type: ignore[attr-defined]
        pass


def test_an_engine_beside_busy_processes_drops_to_one_thread(tiny_llama_dir: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(governor_mod, "PROBE_S", 600.0)        # judge the drop alone, without probes back
    before = torch.get_num_threads()
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    spinners = [ctx.Process(target=spin, args=(stop,), daemon=True) for _ in range(2)]
    try:
        llm = LLM(model=str(tiny_llama_dir), torch_threads=2)
        gov = llm.engine.core.threads
        assert gov is not None and torch.get_num_threads() == 2
        for p in spinners:
            p.start()
        params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        deadline = time.monotonic() + 120
        while gov.threads == 2 and time.monotonic() < deadline:
            llm.generate([[5 + i] * 40 for i in range(4)], params, use_tqdm=False)
        assert gov.threads == 1 and torch.get_num_threads() == 1 and gov.changes >= 1
        assert llm.engine.core.stats().torch_threads == 1
    finally:
        stop.set()
        for p in spinners:
            p.join(10)
        torch.set_num_threads(before)
