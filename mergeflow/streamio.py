"""Writing a byte stream to a file while a second thread hashes it, in order."""

from __future__ import annotations

import hashlib
import os
import queue
import threading

BLOCK = 16 * 1024 * 1024
_DONE = None


class HashingWriter:
    """os.write the blocks in this thread, sha256 them in another: the two overlap on two cores.

    Blocks are views into tensors or mmaps, never copies; the bounded queue keeps at most a
    few blocks alive, so memory stays flat however large the stream is.
    """

    def __init__(self, fd: int, depth: int = 8) -> None:
        self.fd = fd
        self.bytes = 0
        self._digest = hashlib.sha256()
        self._queue: queue.Queue[memoryview | None] = queue.Queue(maxsize=depth)
        self._thread = threading.Thread(target=self._hash, name="sha256-writer", daemon=True)
        self._thread.start()
        self._closed = False

    def _hash(self) -> None:
        while (block := self._queue.get()) is not _DONE:
            self._digest.update(block)

    def write(self, view: memoryview) -> int:
        """Write all of `view`; returns its length."""
        view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
        for start in range(0, len(view), BLOCK):
            block = view[start : start + BLOCK]
            self._queue.put(block)
            while len(block):
                block = block[os.write(self.fd, block) :]
        self.bytes += len(view)
        return len(view)

    def hexdigest(self) -> str:
        """Finish hashing (waits for the hasher) and return the sha256 of everything written."""
        self.close()
        return self._digest.hexdigest()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(_DONE)
            self._thread.join()

    def __enter__(self) -> "HashingWriter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
