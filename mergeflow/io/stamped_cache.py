"""A small LRU of things parsed from checkpoint files, keyed so a stale entry never hits (one per export: mergeflow.io.session)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

from mergeflow.io.fs import FileStamp

V = TypeVar("V")
# (path, the file's stamp when parsed, --trust-checkpoint): a rewritten file misses, and what only
# loaded with --trust-checkpoint is never handed to an export that did not pass it.
StampedKey = tuple[str, FileStamp, bool]


class StampedCache(Generic[V]):
    """Parsed rank files or DCP metadata, shared by the tasks of one export (thread-safe, bounded)."""

    def __init__(self, capacity: int) -> None:
        self._items: OrderedDict[StampedKey, V] = OrderedDict()
        self._lock = threading.Lock()
        self._capacity = capacity

    def get_or_load(self, key: StampedKey, load: Callable[[], V]) -> V:
        """The cached value, or `load()`'s (run outside the lock: parsing may take a while) cached."""
        with self._lock:
            cached = self._items.get(key)
            if cached is not None:
                self._items.move_to_end(key)
                return cached
        value = load()
        with self._lock:
            self._items[key] = value
            while len(self._items) > self._capacity:
                self._items.popitem(last=False)
        return value

    def __iter__(self) -> Iterator[StampedKey]:
        with self._lock:
            return iter(list(self._items))
