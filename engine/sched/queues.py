"""TenantQueues: the scheduler's waiting requests, one FIFO queue per tenant, served round-robin; and
`pick_victim`, whom the scheduler preempts when it must (the busiest tenant's youngest).

A tenant is an opaque key on each request (`Sequence.tenant`; the service sets it from the API key, "" when
there are no keys); the engine never interprets it. Within a tenant, first come first served; between
tenants, turns: the scheduler admits from the tenant whose turn it is, then passes the turn on (`served`).
So a tenant with work waiting is admitted within one turn of every other tenant that has work waiting,
whatever those tenants queued: one tenant's burst of long prompts no longer holds another's short request
for minutes (issue 34, item 6: FCFS across tenants held a 4-token completion for 396 s).

Why a dict of deques plus a deque of turns (not one priority queue): admission walks the turns in order and,
within a tenant, the few requests at its head (a request waiting for a block another is computing lets the
next one go); append, popleft and rotation are O(1), and removing a request from the middle (an abort) is
O(its tenant's queue), as for the single deque before. With one tenant (no keys) it is exactly FCFS.

Iteration (`__iter__`) goes tenant by tenant in turn order, each in FIFO order.
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Collection, Iterator

from engine.sequence import Sequence


class TenantQueues:
    def __init__(self) -> None:
        self._queues: dict[str, deque[Sequence]] = {}
        self._turns: deque[str] = deque()       # tenants with work waiting; the first one's turn is next
        self._count = 0

    def __len__(self) -> int:
        return self._count

    def __bool__(self) -> bool:
        return self._count > 0

    def __iter__(self) -> Iterator[Sequence]:
        for tenant in list(self._turns):
            yield from list(self._queues[tenant])

    def __contains__(self, seq: object) -> bool:
        if not isinstance(seq, Sequence):
            return False
        q = self._queues.get(seq.tenant)
        return q is not None and seq in q

    def __getitem__(self, i: int) -> Sequence:
        return list(self)[i]

    def next(self, skip: set[int]) -> Sequence | None:
        """The first waiting sequence of the tenant whose turn it is, passing over those in `skip` (seq ids)."""
        for tenant in self._turns:
            for seq in self._queues[tenant]:
                if seq.seq_id not in skip:
                    return seq
        return None

    def count(self, tenant: str) -> int:
        """Requests of `tenant` waiting."""
        q = self._queues.get(tenant)
        return len(q) if q is not None else 0

    def tenants(self) -> list[str]:
        """Tenants with work waiting, in turn order."""
        return list(self._turns)

    def queue(self, tenant: str) -> tuple[Sequence, ...]:
        """A tenant's waiting sequences, first come first."""
        return tuple(self._queues.get(tenant, ()))

    def append(self, seq: Sequence) -> None:
        """A new arrival: the back of its tenant's queue (a tenant new to the queue takes the last turn)."""
        self._queue(seq.tenant, front=False).append(seq)
        self._count += 1

    def appendleft(self, seq: Sequence) -> None:
        """A sequence coming back (preempted, or its group not admitted whole): the front of its tenant's queue,
        and that tenant's turn is next (it had been admitted once already)."""
        q = self._queue(seq.tenant, front=True)
        if self._turns[0] != seq.tenant:
            self._turns.remove(seq.tenant)
            self._turns.appendleft(seq.tenant)
        q.appendleft(seq)
        self._count += 1

    def remove(self, seq: Sequence) -> None:
        """Raises ValueError if it is not waiting."""
        q = self._queues.get(seq.tenant)
        if q is None:
            raise ValueError(f"{seq!r} is not waiting")
        q.remove(seq)
        self._count -= 1
        if not q:
            del self._queues[seq.tenant]
            self._turns.remove(seq.tenant)

    def served(self, tenant: str) -> None:
        """`tenant` was admitted a request: the turn passes to the next tenant."""
        if tenant in self._queues and self._turns[0] == tenant and len(self._turns) > 1:
            self._turns.rotate(-1)
        elif tenant in self._queues and self._turns[0] != tenant:
            self._turns.remove(tenant)
            self._turns.append(tenant)

    def by_tenant(self) -> Counter[str]:
        return Counter({t: len(q) for t, q in self._queues.items()})

    def _queue(self, tenant: str, front: bool) -> deque[Sequence]:
        q = self._queues.get(tenant)
        if q is None:
            q = self._queues[tenant] = deque()
            if front:
                self._turns.appendleft(tenant)
            else:
                self._turns.append(tenant)
        return q


def pick_victim(running: list[Sequence], spare: Collection[int] = (), exclude: str | None = None,
                keep_one: bool = False) -> Sequence | None:
    """Whom to preempt among `running` (oldest first): the youngest sequence of the tenant that runs the most
    (with one tenant, the youngest), passing over the seq ids in `spare`, tenant `exclude` and, `keep_one`, any
    tenant running only one; None if none is left."""
    counts = Counter(s.tenant for s in running)
    best: Sequence | None = None
    for seq in reversed(running):               # youngest first: the first of the most-running tenant wins
        if seq.tenant == exclude or seq.seq_id in spare or keep_one and counts[seq.tenant] < 2:
            continue
        if best is None or counts[seq.tenant] > counts[best.tenant]:
            best = seq
    return best
