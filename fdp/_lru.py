"""``LRU``: the one bounded cache of fdp (and ``fdp.kernels``): a map that forgets its least
recently used entry first, safe when simulated ranks (threads of one process) share it.

Every cache of derived, rebuildable values goes through it: tree structures by key tuple and
permutations between them (``fdp._tree``), layout digests (``fdp._sync``), the inner
optimizers of ``inject_hyperparams``, a Reducer's fused engines, the copy kernels' plans and
tables (``fdp.kernels``).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

__all__ = ["LRU"]

_MISSING = object()


class LRU(Generic[K, V]):
    """At most ``size`` entries; the least recently used (got or put) goes first.

    ``get(key, make)`` returns the entry, making it with ``make()`` on a miss (outside the lock:
    two threads may make the same entry at once, and the later one stays; entries are values
    derived from their key, so either is right).

    Example:
      >>> cache = LRU(2)
      >>> cache.get("a", lambda: 1), cache.get("b", lambda: 2), cache.get("a", lambda: 0)
      (1, 2, 1)
      >>> cache.get("c", lambda: 3)
      3
      >>> list(cache.keys())  # "b", the least recently used, went
      ['a', 'c']
    """

    __slots__ = ("size", "table", "_lock")

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"LRU: size must be >= 1, got {size}")
        self.size = size
        # The entries, least recently used first. A caller on a hot path may read a hit from it
        # directly (``cache.table.get(key)``: one C call, no lock, the order left as it is);
        # every write goes through ``put``.
        self.table: OrderedDict[K, V] = OrderedDict()
        self._lock = threading.Lock()

    def peek(self, key: K, default: V | None = None) -> V | None:
        """The entry of ``key`` (it becomes the most recently used), or ``default``."""
        with self._lock:
            value = self.table.get(key, _MISSING)
            if value is _MISSING:
                return default
            self.table.move_to_end(key)
            return value

    def put(self, key: K, value: V) -> V:
        """Store ``value`` under ``key`` (the most recently used); returns it."""
        with self._lock:
            self.table[key] = value
            self.table.move_to_end(key)
            while len(self.table) > self.size:
                self.table.popitem(last=False)
        return value

    def get(self, key: K, make: Callable[[], V]) -> V:
        """The entry of ``key`` (None included), made with ``make()`` on a miss."""
        value = self.peek(key, _MISSING)
        return self.put(key, make()) if value is _MISSING else value

    def clear(self) -> None:
        with self._lock:
            self.table.clear()

    def keys(self) -> Iterator[K]:
        with self._lock:
            return iter(list(self.table))

    def __len__(self) -> int:
        return len(self.table)
