"""sha256 of the rank files, computed in the background from the moment they are known.

The manifest needs every rank file's sha256: a full pass over the checkpoint that nothing
else needs in that order. Started when inspection has found the rank files, it runs while
the rest of the process is busy with work that holds the GIL (imports, building the schema,
Prefect's bookkeeping) and sha256 does not: the pass costs the idle core, not wall time.
The hash tasks then take the digest computed for the very file stamp they were planned with,
and hash the file themselves when there is none (another process, a changed file, a rerun).
"""

from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path

from mergeflow.io.fs import FileStamp, sha256_file


@dataclass
class _Job:
    path: Path
    done: threading.Event = field(default_factory=threading.Event)
    digest: str | None = None
    stamp: FileStamp | None = None  # the file's stamp, unchanged from before to after hashing
    cancelled: bool = False


class DigestPrefetch:
    """One daemon thread hashing queued files in order; results keyed by path, checked by stamp.

    A daemon thread, not an executor: a process that ends (a refusal, Ctrl-C) does not wait
    for a gigabyte of hashing nobody will read.
    """

    _jobs: dict[str, _Job] = {}
    _queue: "queue.Queue[_Job]" = queue.Queue()
    _lock = threading.Lock()
    _thread: threading.Thread | None = None

    @classmethod
    def start(cls, paths: list[Path]) -> None:
        """Queue files for hashing (each once; a file already queued or hashed is left as it is)."""
        with cls._lock:
            for path in paths:
                key = str(path)
                if key in cls._jobs and not cls._jobs[key].cancelled:
                    continue
                job = cls._jobs[key] = _Job(path)
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
                    digest = sha256_file(job.path)
                    if FileStamp.of(job.path) == before:
                        job.digest, job.stamp = digest, before
            except OSError:
                pass  # the hash task hashes the file itself and reports the error
            finally:
                job.done.set()

    @classmethod
    def take(cls, path: Path, stamp: FileStamp) -> str | None:
        """The digest of `path` as it was with exactly `stamp`, waiting for it if queued; else None."""
        with cls._lock:
            job = cls._jobs.get(str(path))
        if job is None or job.cancelled:
            return None
        job.done.wait()
        return job.digest if job.stamp == stamp else None

    @classmethod
    def forget(cls, directory: Path) -> None:
        """Drop (and stop queued work on) the files of one directory once its export is over."""
        prefix = str(directory)
        with cls._lock:
            for key in [k for k in cls._jobs if str(Path(k).parent) == prefix]:
                cls._jobs.pop(key).cancelled = True
