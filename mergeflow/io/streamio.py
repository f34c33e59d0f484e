"""Writing a byte stream to a file while other threads hash it and push it to disk."""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

from mergeflow.io.ranges import READ_BLOCK, RangeHasher

BLOCK = 16 * 1024 * 1024
_DONE = None


class HashingWriter:
    """os.write the blocks in this thread, sha256 them in another: the two overlap on two cores.

    Blocks are views into tensors or mmaps, never copies; the bounded queue keeps at most a
    few blocks alive, so memory stays flat however large the stream is.
    """

    def __init__(self, fd: int, depth: int = 8, flush: BackgroundFlush | None = None, start: int = 0,
                 hashing: bool = True, follower: TrailingHasher | None = None,
                 ranges: RangeHasher | None = None) -> None:
        if ranges is not None and (start or not hashing):
            raise ValueError("a range hasher is fed the whole file from its first byte")
        self.fd = fd
        self.ranges = ranges  # the same blocks, hashed per range on a third thread
        self.flush = flush
        self.follower = follower  # told how far the file is written, like `flush`
        self.start = start  # where the stream begins in the file (bytes written before it are not hashed)
        self.bytes = 0
        self._digest = hashlib.sha256()
        self._queue: queue.Queue[memoryview | None] = queue.Queue(maxsize=depth)
        # hashing=False: a TrailingHasher hashes the file instead (its header is only known later).
        self._thread: threading.Thread | None = None
        if hashing:
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
            end = self.start + self.bytes + start + len(block)
            if self._thread is not None:
                self._queue.put(block)
            if self.ranges is not None:
                self.ranges.update(block)
            while len(block):
                block = block[os.write(self.fd, block) :]
            if self.flush is not None:
                self.flush.written(end)
            if self.follower is not None:
                self.follower.written(end)
        self.bytes += len(view)
        return len(view)

    def hexdigest(self) -> str:
        """Finish hashing (waits for the hasher) and return the sha256 of everything written."""
        self.close()
        if self._thread is None:
            raise RuntimeError("this writer was not hashing")
        return self._digest.hexdigest()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._thread is not None:
                self._queue.put(_DONE)
                self._thread.join()

    def __enter__(self) -> HashingWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class TrailingHasher:
    """The sha256 of a file while it is being written, read back from the page cache behind the writer.

    For a file whose header is only final once its data are hashed (a single file's
    modelspec.hash_sha256): the writer streams the data under a placeholder header while
    `header()` (which waits for the data's hash, taken ahead of the writer from the sources)
    gives the final header bytes; this thread hashes those, then the data section as the
    writer reports it written. The file's hash is then ready when the writer finishes,
    instead of a second pass over the whole file after it.
    """

    def __init__(self, path: os.PathLike[str] | str, data_start: int, header: Callable[[], bytes],
                 ranges: RangeHasher | None = None) -> None:
        if ranges is not None and not ranges.inline:
            raise ValueError("the trailing hasher reuses its buffer: its range hasher must hash inline")
        self.data_start = data_start
        self.ranges = ranges  # fed every block hashed here, header first: the file's per-range digests
        self._header = header
        self._digest = hashlib.sha256()
        self._written = data_start
        self._final: int | None = None
        self._stopped = False
        self._error: BaseException | None = None
        self.header: bytes | None = None  # the header it hashed, for the caller to compare with the one written
        self._cond = threading.Condition()
        self._fd = os.open(path, os.O_RDONLY)
        self._thread = threading.Thread(target=self._run, name="sha256-trailing", daemon=True)
        self._thread.start()

    def written(self, total: int) -> None:
        """The writer has written `total` bytes from the start of the file."""
        with self._cond:
            self._written = total
            self._cond.notify()

    def _next_end(self, pos: int) -> int | None:
        with self._cond:
            while not self._stopped and self._written <= pos and (self._final is None or pos < self._final):
                self._cond.wait()
            if self._stopped or (self._final is not None and pos >= self._final):
                return None
            return self._written

    def _run(self) -> None:
        try:
            header = self._header()
            if len(header) != self.data_start:
                raise ValueError(f"the final header is {len(header)} bytes, the data start at {self.data_start}")
            self.header = header
            self._digest.update(header)
            if self.ranges is not None:
                self.ranges.update(header)
            pos = self.data_start
            # One L2-sized buffer for the whole file. os.pread returned a new 16 MiB bytes object per
            # block, each a fresh mapping (above glibc's mmap threshold, io/heap.py) faulted in and
            # zeroed before the copy: at real depth (5.3 GB) the single-file export's minor faults went
            # from 2.58 M to 1.28 M and its system time from ~12.5 s to ~9 s with this buffer. The range
            # digests (an inline RangeHasher) then hash each block from L2 right after the file's digest.
            buffer = bytearray(READ_BLOCK)
            while (end := self._next_end(pos)) is not None:
                while pos < end:
                    n = os.preadv(self._fd, [memoryview(buffer)[: min(READ_BLOCK, end - pos)]], pos)
                    if not n:
                        raise OSError(f"the file being hashed ended at {pos} bytes, {end} were written")
                    block = memoryview(buffer)[:n]
                    self._digest.update(block)
                    if self.ranges is not None:
                        self.ranges.update(block)
                    pos += n
        except BaseException as exc:  # re-raised in the writer's thread by finish()
            self._error = exc

    def finish(self, size: int) -> str:
        """Wait until all `size` bytes of the finished file are hashed; return its sha256."""
        with self._cond:
            self._written = size
            self._final = size
            self._cond.notify()
        self._close()
        if self._error is not None:
            raise self._error
        return self._digest.hexdigest()

    def abort(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._close()

    def _close(self) -> None:
        self._thread.join()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class BackgroundFlush:
    """Durability off the writer's thread: early writeback while writing, fsync at the end.

    Every `step` bytes the range just written is handed to sync_file_range(WRITE), which
    starts writeback without waiting for it (what PostgreSQL's *_flush_after settings do),
    so the final fsync finds little left to write instead of a gigabyte of dirty pages.
    All calls run in one second thread; the pages stay cached for the read-back.
    join() waits for the final fsync; check() then re-raises its error (ENOSPC surfaces here).
    """

    def __init__(self, fd: int, step: int = 64 * 1024 * 1024) -> None:
        self.fd = fd
        self.step = step
        self._started = 0
        self._abandoned = False
        self._error: OSError | None = None
        self._queue: queue.Queue[tuple[int, int] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="flush", daemon=True)
        self._thread.start()

    def written(self, total: int) -> None:
        """The writer has written `total` bytes from the start of the file."""
        if total - self._started >= self.step:
            self._queue.put((self._started, total - self._started))
            self._started = total

    def fsync(self) -> None:
        """Queue the final fsync; returns at once."""
        self._queue.put(None)

    def _run(self) -> None:
        try:
            while (item := self._queue.get()) is not None:
                start_writeback(self.fd, *item)
            if not self._abandoned:
                os.fsync(self.fd)
        except OSError as exc:
            self._error = exc

    def abandon(self) -> None:
        """Stop without the final fsync: the write failed and its file will be rewritten."""
        self._abandoned = True
        self.join()

    def join(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)  # a second None after fsync() is never read
            self._thread.join()

    def check(self) -> None:
        self.join()
        if self._error is not None:
            raise self._error


def _sync_file_range() -> Any:
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    func = getattr(libc, "sync_file_range", None)
    if func is not None:
        func.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
        func.restype = ctypes.c_int
    return func


_SYNC_FILE_RANGE = _sync_file_range()
_SYNC_FILE_RANGE_WRITE = 2


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Ask the kernel to start writing a range to disk, without waiting (a hint: no-op where unsupported)."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE)
