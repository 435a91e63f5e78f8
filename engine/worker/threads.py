"""ThreadGovernor: the engine's compute threads, fewer while another process wants the same cores.

The forward pass runs as hundreds of OpenMP regions a step, each ending at a barrier: with N threads on N
cores and a busy neighbour on one of them, every region waits for the thread the kernel descheduled, a
scheduler time slice at a time. Measured on a 2-core Zen 3 with one spinning process beside it: a 1,024-token
prefill took 19.9 s with 2 threads and 4.56 s with 1; 8 x 128/32 tokens 104.7 s against 6.67 s. vLLM's CPU
backend suffers the same (its OpenMP threads are bound to cores), less because it runs fewer regions a step.

The signal is the kernel's own: /proc/self/task/*/schedstat gives each thread's time on a CPU and its time
runnable but waiting for one. Their ratio over the process (waiting / running) was 0.13 with 1 thread beside
the spinner, 0.85-2.7 with 2, and near 0 on an idle machine with 2. The governor, called on the engine thread
at every step that computes:

    every WINDOW_S (once the threads ran MIN_RUN_S in it)   waiting / running > BUSY   one thread fewer (>= 1)
                                                            otherwise, and fewer than the most, after a wait
                                                            that doubles from PROBE_S to PROBE_MOST_S while
                                                            probes fail   one thread more (a probe: the next
                                                            window judges it)

so a neighbour that comes costs about a window, and one that leaves a probe wait (up to a minute). What it
does not see: a neighbour on other cores (no waiting here, and nothing to gain), memory bandwidth taken by
another process. Off (None from `make`) where the thread count is not ours to change: torch's default (offline
LLM()), one thread, the batch-invariant mode (a split by thread count must not move its results), or where
schedstat is not readable (a kernel without CONFIG_SCHEDSTATS).
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
PROBE_S = 5.0           # first wait before trying a thread more; doubles while probes fail
PROBE_MOST_S = 60.0
TASKS = "/proc/self/task"


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


class ThreadGovernor:
    def __init__(self, most: int, set_threads: Callable[[int], None],
                 read: Callable[[], tuple[int, int]] = read_schedstat,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.most = most
        self.threads = most
        self.changes = 0                        # how often the count moved (metrics)
        self._set, self._read, self._clock = set_threads, read, clock
        self._wait_s = PROBE_S
        self._probing = False
        self._mark = (clock(), *read())
        self._probe_at = self._mark[0] + PROBE_S

    @classmethod
    def make(cls, threads: int | None, batch_invariant: bool,
             set_threads: Callable[[int], None]) -> ThreadGovernor | None:
        if threads is None or threads < 2 or batch_invariant:
            return None
        try:
            read_schedstat()
        except (OSError, ValueError, IndexError):
            return None
        return cls(threads, set_threads)

    def tick(self) -> None:
        now = self._clock()
        t0, run0, wait0 = self._mark
        if now - t0 < WINDOW_S:
            return
        run, wait = self._read()
        if run - run0 < MIN_RUN_S * 1e9:
            if now - t0 > 20 * WINDOW_S:        # mostly idle: start the window again rather than judge a trickle
                self._mark = (now, run, wait)
            return
        self._mark = (now, run, wait)
        ratio = (wait - wait0) / (run - run0)
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
            if self.threads < self.most and now >= self._probe_at:
                self._probing = True
                self._change(self.threads + 1, ratio)

    def _change(self, threads: int, ratio: float) -> None:
        log.info("compute threads %d -> %d (threads waited %.2fx the time they ran: %s)", self.threads, threads,
                 ratio, "other processes want these cores" if threads < self.threads else "trying one more")
        self.threads = threads
        self.changes += 1
        self._set(threads)
        self._mark = (self._clock(), *self._read())     # the next window judges the new count alone


__all__ = ["ThreadGovernor", "read_schedstat"]
