"""ThreadGovernor: the engine's compute threads, fewer while another process wants the same cores.

The forward pass runs as hundreds of OpenMP regions a step, each ending at a barrier: with N threads on N
cores and a busy neighbour on one of them, every region waits for the thread the kernel descheduled, a
scheduler time slice at a time. Measured on a 2-core Zen 3 with one spinning process pinned to a core beside
it (`prefixserve bench threads`, README "Quantized weights and threads"): on a fixed 2 threads a 1,024-token
prefill took 8.4 s (2.1 s alone) and 8 x 128/32 tokens 61 s (3.9 s alone); with this governor 3.9 s and 6.6 s.
vLLM's CPU backend suffers the same (its OpenMP threads are bound to cores).

Two signals from the kernel, read every WINDOW_S of compute (checked at each step's start and between the
model's layers, so a prefill step of seconds is not run to its end on the wrong count; a decode step whose layers
run as one C++ call, kernels/cpu/layers.py, is checked before it):
- waiting: /proc/self/task/*/schedstat gives each thread's time on a CPU and its time runnable but waiting for
  one; waiting / running over the process was 0.13 with 1 thread beside the spinner, 0.85-2.7 with 2, under
  0.01 alone with 2;
- free cores: /proc/stat's idle time of the CPUs this process may run on, over the window (about 1 with 1
  thread on an otherwise idle 2-core machine, about 0 beside the spinner).

    waiting / running > BUSY                     one thread fewer (down to 1)
    otherwise, fewer than the most, and a core   one thread more (the next window judges it: a failure drops
    free (> FREE)                                it again and doubles the wait before the next, from PROBE_S
                                                 to PROBE_MOST_S)
    where /proc/stat is unreadable               blind probes instead, on the same doubling wait

so a neighbour that comes costs about a window, and one that leaves about a window. What it does not see: a
neighbour on cores we may not use (nothing to gain), memory bandwidth taken by another process, a cgroup CPU
quota (the thread count starts from it: cli.usable_cores). Off (None from `make`) where the thread count is
not ours to change: torch's default (offline LLM()), one thread, the batch-invariant mode (a split by thread
count must not move its results), or where schedstat is unreadable (a kernel without CONFIG_SCHEDSTATS).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable

log = logging.getLogger("prefixserve.engine")

WINDOW_S = 0.5          # how long a verdict's window lasts, at least
MIN_RUN_S = 0.1         # CPU seconds the process's threads must have run in a window to judge it
BUSY = 0.3              # waiting / running above this: too many threads for the cores we get
FREE = 0.5              # idle cores (of ours) in a window above this: a thread more may find a core
PROBE_S = 5.0           # the wait before trying a thread more after a failed try; doubles while they fail
PROBE_MOST_S = 60.0
TASKS = "/proc/self/task"
STAT = "/proc/stat"


def read_schedstat(tasks: str = TASKS) -> tuple[int, int]:
    """(nanoseconds on a CPU, nanoseconds runnable but waiting), summed over this process's threads; a thread
    that ended meanwhile drops out (its time with it: a window with less run judged on what is left)."""
    run = wait = 0
    for tid in os.listdir(tasks):
        try:
            with open(f"{tasks}/{tid}/schedstat") as f:
                fields = f.read().split()
        except OSError:
            continue
        run += int(fields[0])
        wait += int(fields[1])
    return run, wait


def read_idle(cpus: frozenset[int] | None = None, stat: str = STAT) -> float:
    """Seconds the CPUs this process may use (`cpus`; default its affinity) have been idle (idle + iowait)."""
    cpus = frozenset(os.sched_getaffinity(0)) if cpus is None else cpus
    ticks = 0
    with open(stat) as f:
        for line in f:
            name, _, rest = line.partition(" ")
            if name.startswith("cpu") and name[3:].isdigit() and int(name[3:]) in cpus:
                fields = rest.split()
                ticks += int(fields[3]) + int(fields[4])
    return ticks / os.sysconf("SC_CLK_TCK")


class ThreadGovernor:
    def __init__(self, most: int, set_threads: Callable[[int], None],
                 read: Callable[[], tuple[int, int]] = read_schedstat,
                 idle: Callable[[], float] | None = read_idle,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.most = most
        self.threads = most
        self.changes = 0                        # how often the count moved (metrics)
        self._set, self._read, self._idle, self._clock = set_threads, read, idle, clock
        self._wait_s = PROBE_S
        self._probing = False
        self._mark = self._now()
        self._probe_at = self._mark[0] + PROBE_S

    def _now(self) -> tuple[float, int, int, float]:
        return (self._clock(), *self._read(), self._idle() if self._idle is not None else 0.0)

    @classmethod
    def make(cls, threads: int | None, batch_invariant: bool,
             set_threads: Callable[[int], None]) -> ThreadGovernor | None:
        if threads is None or threads < 2 or batch_invariant:
            return None
        try:
            read_schedstat()
        except (OSError, ValueError, IndexError):
            return None
        try:
            read_idle()
            idle: Callable[[], float] | None = read_idle
        except (OSError, ValueError, IndexError):
            idle = None
        return cls(threads, set_threads, idle=idle)

    def tick(self) -> None:
        t0, run0, wait0, idle0 = self._mark
        if self._clock() - t0 < WINDOW_S:
            return
        now, run, wait, idle = mark = self._now()
        if run - run0 < MIN_RUN_S * 1e9:
            if now - t0 > 20 * WINDOW_S:        # mostly idle: start the window again rather than judge a trickle
                self._mark = mark
            return
        self._mark = mark
        ratio = (wait - wait0) / (run - run0)
        free = (idle - idle0) / (now - t0)
        if ratio > BUSY:
            if self._probing:                   # the thread more did not pay: wait longer before the next try
                self._wait_s = min(2 * self._wait_s, PROBE_MOST_S)
            self._probing = False
            self._probe_at = now + self._wait_s
            if self.threads > 1:
                self._change(self.threads - 1, ratio)
        else:
            if self._probing:
                self._wait_s = PROBE_S
                self._probing = False
            room = free > FREE if self._idle is not None else True
            if self.threads < self.most and room and now >= self._probe_at:
                self._probing = True
                self._change(self.threads + 1, ratio)

    def _change(self, threads: int, ratio: float) -> None:
        log.info("compute threads %d -> %d (threads waited %.2fx the time they ran: %s)", self.threads, threads,
                 ratio, "other processes want these cores" if threads < self.threads else "trying one more")
        self.threads = threads
        self.changes += 1
        self._set(threads)
        self._mark = self._now()                # the next window judges the new count alone


__all__ = ["ThreadGovernor", "read_idle", "read_schedstat"]
