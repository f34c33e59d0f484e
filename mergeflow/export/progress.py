"""Who hears about the bytes the shard writers stream: the command line's progress display.

Shard writers run as Prefect tasks in worker threads of the same process, so a display cannot be
passed to them as an argument (task arguments are recorded and hashed). It subscribes here
instead, for the duration of a `with` block; with no subscriber, reporting costs one list check.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

Listener = Callable[[int, int], None]  # (bytes written, tensors written) since the last call


class WriteProgress:
    """The listeners of one process's shard writes."""

    def __init__(self) -> None:
        self._listeners: tuple[Listener, ...] = ()
        self._lock = threading.Lock()

    @contextmanager
    def listening(self, listener: Listener) -> Iterator[None]:
        """Call `listener` after every tensor written while the block runs."""
        with self._lock:
            self._listeners = (*self._listeners, listener)
        try:
            yield
        finally:
            with self._lock:
                self._listeners = tuple(x for x in self._listeners if x is not listener)

    def report(self, nbytes: int, ntensors: int) -> None:
        for listener in self._listeners:  # a tuple swapped whole: safe to read without the lock
            listener(nbytes, ntensors)


WRITE_PROGRESS = WriteProgress()
