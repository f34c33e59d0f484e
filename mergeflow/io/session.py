"""What one export keeps while it runs: an object owned by that export, dropped with it.

An `ExportSession` is made by whoever starts an export (the command line before its pre-flight,
else the merge flow itself) and found by the code below through a ContextVar: Prefect's thread
task runner copies the context into its task threads, so every task of the export sees the same
session. Where no export set one (a Dask worker in another process, a direct call in a test),
`current_session()` gives a fresh one for that call, as an empty process-wide cache was before.
Nothing process-wide is cleared at the end: when the export is over its session is no longer referenced
(its queued hashing is stopped, not left running for nobody).

It holds the background digests of the checkpoint's files, the texts of the small metadata files
already read (so the pre-flight, the plan and the checks read each one once), the plan's first
stage when the command line ran it before Prefect started, the checkpoint's parsed rank files
or `.metadata` that the tasks share, and who listens to its shard writes (the flow's progress).
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from mergeflow.io import fs
from mergeflow.io.fs import FileStamp
from mergeflow.io.prefetch import DigestPrefetch
from mergeflow.io.stamped_cache import StampedCache

T = TypeVar("T")

WriteListener = Callable[[int, int], None]  # (bytes written, tensors written) since the last call


class WriteListeners:
    """Who hears of an export's shard writes, tensor by tensor.

    The shard writers run as Prefect tasks in worker threads, so a listener cannot be passed to
    them as an argument (task arguments are recorded and hashed); it subscribes to the export's
    session instead. With no subscriber, reporting costs one tuple check.
    """

    def __init__(self) -> None:
        self._listeners: tuple[WriteListener, ...] = ()
        self._lock = threading.Lock()

    @contextmanager
    def listening(self, listener: WriteListener) -> Iterator[None]:
        """Call `listener` after every tensor written while the block runs."""
        self.add(listener)
        try:
            yield
        finally:
            self.remove(listener)

    def add(self, listener: WriteListener, *, first: bool = False) -> None:
        """Call `listener` after every tensor written from now on; `first`: ahead of those already listening."""
        with self._lock:
            self._listeners = (listener, *self._listeners) if first else (*self._listeners, listener)

    def remove(self, listener: WriteListener) -> None:
        with self._lock:
            self._listeners = tuple(x for x in self._listeners if x is not listener)

    def report(self, nbytes: int, ntensors: int) -> None:
        for listener in self._listeners:  # a tuple swapped whole: safe to read without the lock
            listener(nbytes, ntensors)


@dataclass(eq=False)
class ExportSession:
    """The state of one export: digests, metadata texts read, the first planning stage, its write listeners."""

    digests: DigestPrefetch = field(default_factory=DigestPrefetch)
    writes: WriteListeners = field(default_factory=WriteListeners)
    _files: dict[str, tuple[FileStamp, bytes]] = field(default_factory=dict)
    _memo: dict[tuple[str, str], Any] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _reading: threading.Lock = field(default_factory=threading.Lock)

    def read_bytes(self, path: Path) -> bytes:
        """A small metadata file's bytes, read once per export while its stamp is unchanged."""
        with self._reading:  # two threads asking at once (the plan, the background hash): one read
            known = self.known_bytes(path)
            if known is not None:
                return known
            stamp = FileStamp.of(path)  # before the read: a file rewritten meanwhile is read again next time
            data = path.read_bytes()
            with self._lock:
                self._files[str(path)] = (stamp, data)
            return data

    def known_bytes(self, path: Path) -> bytes | None:
        """The bytes `read_bytes` kept of `path`, if the file still has the stamp they were read at."""
        with self._lock:
            known = self._files.get(str(path))
        if known is None:
            return None
        try:
            unchanged = FileStamp.of(path) == known[0]  # a stat, not an open
        except OSError:
            return None
        return known[1] if unchanged else None

    def once(self, kind: str, key: str, compute: Callable[[], T]) -> T:
        """`compute()`'s value for (kind, key), computed once per export (a raised refusal is not kept)."""
        with self._lock:
            if (kind, key) in self._memo:
                return self._memo[(kind, key)]  # type: ignore[no-any-return]
        value = compute()
        with self._lock:
            self._memo[(kind, key)] = value
        return value

    def cache(self, name: str, capacity: int) -> StampedCache[Any]:
        """The export's cache called `name` (parsed rank files, a DCP's parsed .metadata), made on first use."""
        return self.once("cache", name, lambda: StampedCache(capacity))

    def close(self) -> None:
        """The export is over: hashing nobody will take stops; the rest goes with the object."""
        self.digests.cancel()

    def recall(self, kind: str, key: str) -> Any:
        """What `once` kept for (kind, key), else None; computes nothing."""
        with self._lock:
            return self._memo.get((kind, key))


_CURRENT: ContextVar[ExportSession | None] = ContextVar("mergeflow_export_session", default=None)


def current_session() -> ExportSession:
    """The session of the export this code runs for; a fresh one where none was set (another process)."""
    return _CURRENT.get() or ExportSession()


def active_session() -> ExportSession | None:
    """The session an export set in this context, if any."""
    return _CURRENT.get()


def carry_session(fn: Callable[..., T]) -> Callable[..., T]:
    """`fn` to run in another thread of this export (a pool's): there it finds this export's session too."""
    session = _CURRENT.get()
    if session is None:
        return fn

    def run(*args: Any, **kwargs: Any) -> T:
        token = _CURRENT.set(session)
        try:
            return fn(*args, **kwargs)
        finally:
            _CURRENT.reset(token)

    return run


def enter_session(session: ExportSession | None = None) -> Callable[[], None]:
    """Run an export in the session already set in this context (the CLI's), else in `session` or a new one.

    Returns what ends it: a session entered here is unset and closed (its queued hashing stopped);
    one found here stays its owner's.
    """
    if _CURRENT.get() is not None:
        return lambda: None
    own = session or ExportSession()
    token = _CURRENT.set(own)

    def leave() -> None:
        _CURRENT.reset(token)
        own.close()

    return leave


@contextmanager
def export_session(session: ExportSession | None = None) -> Iterator[ExportSession]:
    """`enter_session` as a `with` block, yielding the session the export runs in."""
    leave = enter_session(session)
    try:
        yield _CURRENT.get()  # type: ignore[misc]
    finally:
        leave()


def sha256_file(path: Path) -> str:
    """sha256 of a file; a file this export already read (a config) is hashed from those very bytes, not opened again."""
    session = active_session()
    known = session.known_bytes(path) if session is not None else None
    if known is not None:
        return hashlib.sha256(known).hexdigest()
    return fs.sha256_file(path)
