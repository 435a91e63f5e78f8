"""GrammarCache: compiled grammars kept for reuse, least recently used first out, bounded by count and bytes.

Every distinct schema a client sends compiles to its own grammar (a few MB each on a 49k vocabulary, tens of
MB for a schema with many length-bounded strings), so the cache is bounded both ways: `max_entries` and
`max_bytes` (each grammar's size as xgrammar reports it). A grammar larger than `max_bytes` on its own is not
kept (its request holds it while it runs). An evicted grammar is only compiled again when asked for again.

Why an OrderedDict: a hit moves its key to the end and eviction pops the front, both O(1), with no second
structure to keep in step. Standard library only; thread-safe (one lock: the grammar threads fill it, the
engine thread never touches it).
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Any


class GrammarCache:
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("a grammar cache holds at least one entry and one byte")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._items: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()   # key -> (grammar, bytes)
        self._bytes = 0
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> Any | None:
        with self._lock:
            item = self._items.get(key)
            if item is None:
                return None
            self._items.move_to_end(key)
            return item[0]

    def put(self, key: Hashable, grammar: Any, size: int) -> bool:
        """Keeps `grammar` (evicting the least recently used as needed); False when it alone is over
        `max_bytes` and is not kept."""
        if size > self.max_bytes:
            return False
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            self._items[key] = (grammar, size)
            self._bytes += size
            while len(self._items) > self.max_entries or self._bytes > self.max_bytes:
                _, (_, dropped) = self._items.popitem(last=False)
                self._bytes -= dropped
        return True

    def keys(self) -> list[Hashable]:
        """Least recently used first."""
        with self._lock:
            return list(self._items)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)
