"""A progress line on stderr (bytes and tensors written) for the command line."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from mergeflow.tasks.write import PROGRESS_HOOKS


class StderrProgress:
    """Counts what the shard writers report and redraws one line at most every 0.2 s."""

    def __init__(self, stream=sys.stderr) -> None:  # type: ignore[no-untyped-def]
        self.stream = stream
        self.bytes = 0
        self.tensors = 0
        self._lock = threading.Lock()
        self._last = 0.0
        self._start = time.monotonic()

    def __call__(self, nbytes: int, ntensors: int) -> None:
        with self._lock:
            self.bytes += nbytes
            self.tensors += ntensors
            now = time.monotonic()
            if now - self._last >= 0.2:
                self._last = now
                self._draw(now)

    def _draw(self, now: float) -> None:
        rate = self.bytes / max(now - self._start, 1e-6) / 1e6
        self.stream.write(f"\rmergeflow: {self.tensors} tensors, {self.bytes / 1e6:.1f} MB written ({rate:.0f} MB/s)")
        self.stream.flush()

    def finish(self) -> None:
        if self.tensors:
            self._draw(time.monotonic())
            self.stream.write("\n")
            self.stream.flush()


@contextmanager
def stderr_progress() -> Iterator[StderrProgress]:
    bar = StderrProgress()
    PROGRESS_HOOKS.append(bar)
    try:
        yield bar
    finally:
        PROGRESS_HOOKS.remove(bar)
        bar.finish()
