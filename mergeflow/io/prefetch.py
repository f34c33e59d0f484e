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

import contextvars
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

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
    for a gigabyte of hashing nobody will read. One per export (mergeflow.io.session.ExportSession):
    dropped with the export, its thread ends once its queue is empty.
    """

    def __init__(self) -> None:
        self._jobs: dict[str, _Job] = {}
        self._queue: queue.Queue[_Job] = queue.Queue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self, paths: list[Path], hasher: Hasher = sha256_file) -> None:
        """Queue files for hashing with `hasher` (each once; a file already queued or hashed with it is left as it is)."""
        with self._lock:
            for path in paths:
                key = str(path)
                queued = self._jobs.get(key)
                if queued is not None and not queued.cancelled:
                    if queued.hasher is hasher:
                        continue
                    queued.cancelled = True  # asked for with another hasher: the later request decides
                job = self._jobs[key] = _Job(path, hasher)
                self._queue.put(job)
            if self._thread is None or not self._thread.is_alive():
                # In the export's context: a hasher finds the export's session (DCP: its parsed .metadata).
                run = contextvars.copy_context().run
                self._thread = threading.Thread(target=run, args=(self._run,), name="rank-digests", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                job = self._queue.get(timeout=1.0)
            except queue.Empty:
                with self._lock:
                    if self._queue.empty():
                        self._thread = None
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

    def take(self, path: Path, stamp: FileStamp, hasher: Hasher = sha256_file) -> str | None:
        """`hasher`'s digest of `path` as it was with exactly `stamp`, waiting for it if queued; else None.

        Raises the hasher's error (a CheckpointError for a damaged rank file) when that was its verdict.
        """
        with self._lock:
            job = self._jobs.get(str(path))
        if job is None or job.cancelled or job.hasher is not hasher:
            return None
        job.done.wait()
        if job.stamp != stamp:
            return None
        if job.error is not None:
            raise job.error
        return job.digest

    def cancel(self) -> None:
        """Stop queued work (an export refused before its hash tasks ran)."""
        with self._lock:
            for job in self._jobs.values():
                job.cancelled = True
            self._jobs.clear()
