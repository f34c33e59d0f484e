"""Per-range sha256 digests of a large file: taken while it is written, checked in parallel by `test`.

SHA-256 cannot be split: one file's digest is one thread's work (~1.1 GB/s here), so a 5 GB single
file takes 5 s to check however many cores there are. The manifest therefore also records the
digest of each consecutive `range_size` bytes of a large file, next to its whole-file sha256 (which
stays, for `sha256sum -c` and the signature); `test` checks the ranges on every core at once.
"""

from __future__ import annotations

import hashlib
import os
import queue
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from mergeflow.io import fs

# 64 MiB: a 5 GB file is 80 ranges, enough to keep any number of cores busy to the end, while a
# range's digest is a small part of the manifest (64 hex characters per 64 MiB).
RANGE_SIZE = 64 * 1024 * 1024
# Range sizes a manifest may name: whole pages, so a range can be read (or mapped) on its own.
RANGE_ALIGN = 4096
# A range is read in blocks this size: the buffer stays in L2 between the read and the hash.
READ_BLOCK = 1024 * 1024
_DONE = None


@dataclass(frozen=True)
class FileRanges:
    """The sha256 of each consecutive `range_size` bytes of a `size`-byte file (the last range may be shorter)."""

    size: int
    range_size: int
    sha256: tuple[str, ...]

    def to_json(self) -> dict[str, object]:
        return {"size": self.size, "range_size": self.range_size, "sha256": list(self.sha256)}

    def span(self, index: int) -> tuple[int, int]:
        """(offset, length) of range `index`."""
        offset = index * self.range_size
        return offset, min(self.range_size, self.size - offset)


def range_count(size: int, range_size: int) -> int:
    return -(-size // range_size)


# `test` hashes whole files on every core at once, so ranges only shorten it where one file would keep
# the others waiting: a file holding more than 1/RANGES_SHARE of its artifact's bytes. An artifact of four
# or more similar shards (a 24 GB transformer export is twelve 2 GiB files) is checked as fast without
# them, and its export skips a sha256 pass over every byte, the ranges' own: about 20 CPU seconds of a
# 24 GB export on two cores. A fixed share, not this machine's core count: the manifest is the same
# wherever the export runs (a resumed one included).
RANGES_SHARE = 4


def large_share(size: int, artifact_bytes: int) -> bool:
    """Whether a file of `size` bytes holds enough of its artifact's weights bytes to be worth ranges."""
    return size * RANGES_SHARE > artifact_bytes


def wants_ranges(size: int, range_size: int | None = None) -> bool:
    """Only a file of more than one range gains from them; smaller files keep their whole-file digest alone."""
    return size > (range_size or RANGE_SIZE)


class RangeHasher:
    """The sha256 of each consecutive range of a byte stream, on a thread of its own (or inline: below).

    Fed the very blocks a writer writes (or a hasher reads), in file order: its work overlaps the
    writer and the whole-file hasher instead of following them. The blocks are not copied; the
    bounded queue keeps only a few alive. Start it at the file's first byte.
    """

    def __init__(self, range_size: int | None = None, depth: int = 8, *, inline: bool = False) -> None:
        self.range_size = range_size or RANGE_SIZE
        # inline: hashed in the feeder's own thread as each block comes, for a feeder that reuses its
        # buffer (a queued block would be overwritten) and whose block is still in L2 from its own hash.
        self.inline = inline
        self._digests: list[str] = []
        self._digest = hashlib.sha256()
        self._filled = 0
        self._size = 0
        self._error: BaseException | None = None
        self._queue: queue.Queue[memoryview | bytes | None] = queue.Queue(maxsize=depth)
        self._thread: threading.Thread | None = None
        if not inline:
            self._thread = threading.Thread(target=self._run, name="sha256-ranges", daemon=True)
            self._thread.start()
        self._closed = False

    def update(self, block: memoryview | bytes) -> None:
        if self.inline:
            self._hash(memoryview(block).cast("B"))
        else:
            self._queue.put(block)

    def _run(self) -> None:
        try:
            while (block := self._queue.get()) is not _DONE:
                self._hash(memoryview(block).cast("B"))
        except BaseException as exc:  # noqa: BLE001 - re-raised by finish() in the caller's thread
            self._error = exc
            while self._queue.get() is not _DONE:  # keep draining: the producer must never block on a full queue
                pass

    def _hash(self, view: memoryview) -> None:
        self._size += len(view)
        while len(view):
            take = min(len(view), self.range_size - self._filled)
            self._digest.update(view[:take])
            self._filled += take
            view = view[take:]
            if self._filled == self.range_size:
                self._digests.append(self._digest.hexdigest())
                self._digest = hashlib.sha256()
                self._filled = 0

    def finish(self) -> FileRanges:
        """Wait for the blocks queued so far; the ranges of everything fed."""
        self.close()
        if self._error is not None:
            raise self._error
        digests = self._digests + ([self._digest.hexdigest()] if self._filled else [])
        return FileRanges(self._size, self.range_size, tuple(digests))

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._thread is not None:
                self._queue.put(_DONE)
                self._thread.join()


def hash_span(fd: int, offset: int, length: int) -> str:
    """sha256 of `length` bytes at `offset` of an open file, read into one reused L2-sized buffer."""
    digest = hashlib.sha256()
    buffer = bytearray(min(READ_BLOCK, max(length, 1)))
    view = memoryview(buffer)
    end = offset + length
    while offset < end:
        n = os.preadv(fd, [view[: min(len(buffer), end - offset)]], offset)
        if n == 0:
            raise EOFError(f"the file ended at {offset} bytes, {end} were expected")
        digest.update(view[:n])
        offset += n
    return digest.hexdigest()


def file_ranges(path: Path, range_size: int | None = None) -> FileRanges:
    """The ranges of a file on disk, read range by range."""
    range_size = range_size or RANGE_SIZE
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        digests = tuple(hash_span(fd, i * range_size, min(range_size, size - i * range_size))
                        for i in range(range_count(size, range_size)))
    finally:
        os.close(fd)
    return FileRanges(size, range_size, digests)


def file_digests(path: Path, whole: Callable[[Path], str] = fs.sha256_file,
                 take_ranges: bool = True) -> tuple[str, FileRanges | None]:
    """A written file's sha256 and, when it is large (and `take_ranges`, the plan's choice), its ranges: both
    passes at once, on two threads.

    For the writers whose file hash is a pass after writing (a GGUF file, a reused or copied file):
    the file is in the page cache, so the second reader costs a core, not the disk.
    """
    if not take_ranges or not wants_ranges(path.stat().st_size):
        return whole(path), None
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256-ranges") as pool:
        ranges = pool.submit(file_ranges, path)
        digest = whole(path)
        return digest, ranges.result()


def verify_ranges(fds: dict[str, int], ranges: dict[str, FileRanges], workers: int,
                  also: Iterable[tuple[str, Callable[[], str]]] = ()) -> tuple[set[str], dict[str, str]]:
    """Hash every range of every file in a pool of `workers` threads (plus `also`: other hashing jobs by name).

    Returns the names whose ranges do not all match, and the results of `also`. Ranges are
    scheduled file by file in order: each thread ends within one range of the others.
    """
    jobs = [(name, i) for name, record in ranges.items() for i in range(len(record.sha256))]
    failed: set[str] = set()
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="sha256") as pool:
        others = {name: pool.submit(job) for name, job in also}
        checks = {job: pool.submit(hash_span, fds[job[0]], *ranges[job[0]].span(job[1])) for job in jobs}
        for (name, i), future in checks.items():
            try:
                if future.result() != ranges[name].sha256[i]:
                    failed.add(name)
            except EOFError:  # shrank while being checked
                failed.add(name)
        return failed, {name: future.result() for name, future in others.items()}
