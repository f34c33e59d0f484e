"""sha256 of the rank files, computed in the background from the moment they are known.

The manifest needs every rank file's sha256: a full pass over the checkpoint that nothing
else needs in that order. Started when inspection has found the rank files, it runs while
the rest of the process is busy with work that holds the GIL (imports, building the schema,
Prefect's bookkeeping) and sha256 does not: the pass costs the idle core, not wall time.
The hash tasks then take the digest computed for the very file stamp they were planned with,
and hash the file themselves when there is none (another process, a changed file, a rerun).

The hashing function is the caller's (rank files: mergeflow.formats.zip_records, which checks
each record's CRC-32 in the same pass): io sits below formats and does not import it. A digest
or a verdict is handed only to a caller asking with the same function, so a plain digest never
stands in for a checked one.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

from mergeflow.errors import MergeflowError
from mergeflow.io.fs import FileStamp, sha256_file

Hasher = Callable[[Path], str]


@dataclass
class _Job:
    path: Path
    hasher: Hasher
    done: threading.Event = field(default_factory=threading.Event)
    digest: str | None = None
    error: MergeflowError | None = None  # the hasher's verdict on the file (damage), re-raised by take()
    stamp: FileStamp | None = None  # the file's stamp, unchanged from before to after hashing
    cancelled: bool = False


class DigestPrefetch:
    """One daemon thread hashing queued files in order; results keyed by path, checked by stamp.

    A daemon thread, not an executor: a process that ends (a refusal, Ctrl-C) does not wait
    for a gigabyte of hashing nobody will read.
    """

    _jobs: ClassVar[dict[str, _Job]] = {}
    _queue: ClassVar[queue.Queue[_Job]] = queue.Queue()
    _lock: ClassVar[threading.Lock] = threading.Lock()
    _thread: ClassVar[threading.Thread | None] = None

    @classmethod
    def start(cls, paths: list[Path], hasher: Hasher = sha256_file) -> None:
        """Queue files for hashing with `hasher` (each once; a file already queued or hashed with it is left as it is)."""
        with cls._lock:
            for path in paths:
                key = str(path)
                queued = cls._jobs.get(key)
                if queued is not None and not queued.cancelled:
                    if queued.hasher is hasher:
                        continue
                    queued.cancelled = True  # asked for with another hasher: the later request decides
                job = cls._jobs[key] = _Job(path, hasher)
                cls._queue.put(job)
            if cls._thread is None or not cls._thread.is_alive():
                cls._thread = threading.Thread(target=cls._run, name="rank-digests", daemon=True)
                cls._thread.start()

    @classmethod
    def _run(cls) -> None:
        while True:
            try:
                job = cls._queue.get(timeout=1.0)
            except queue.Empty:
                with cls._lock:
                    if cls._queue.empty():
                        cls._thread = None
                        return
                continue
            try:
                if not job.cancelled:
                    before = FileStamp.of(job.path)
                    try:
                        job.digest = job.hasher(job.path)
                    except MergeflowError as exc:
                        job.error = exc  # e.g. a damaged record: the hash task must see it, not hash again
                    if FileStamp.of(job.path) == before:
                        job.stamp = before
                    else:  # changed meanwhile: neither the digest nor a verdict describes the file now
                        job.digest = job.error = None
            except Exception:  # noqa: BLE001 (reported by the hash task, which hashes again)
                # OSError, or any surprise: the hash task hashes the file itself and reports the error.
                # Never let it end this thread, or the jobs queued behind would never be done.
                job.digest = job.error = None
            finally:
                job.done.set()

    @classmethod
    def take(cls, path: Path, stamp: FileStamp, hasher: Hasher = sha256_file) -> str | None:
        """`hasher`'s digest of `path` as it was with exactly `stamp`, waiting for it if queued; else None.

        Raises the hasher's error (a CheckpointError for a damaged rank file) when that was its verdict.
        """
        with cls._lock:
            job = cls._jobs.get(str(path))
        if job is None or job.cancelled or job.hasher is not hasher:
            return None
        job.done.wait()
        if job.stamp != stamp:
            return None
        if job.error is not None:
            raise job.error
        return job.digest

    @classmethod
    def forget(cls, directory: Path) -> None:
        """Drop (and stop queued work on) the files of one directory once its export is over."""
        prefix = str(directory)
        with cls._lock:
            for key in [k for k in cls._jobs if str(Path(k).parent) == prefix]:
                cls._jobs.pop(key).cancelled = True
