"""The operating system's refusals users meet, as mergeflow errors that say what to do.

Disk full, quota, file size limit, permission denied, read-only filesystem, a path that
vanished, a failing disk: each is one line naming the path and the fix, with the exit
status of a refusal. Anything else stays an internal error with its traceback under --debug.
"""

from __future__ import annotations

import errno
import os

from mergeflow.errors import (
    DiskFullError,
    FileAccessError,
    InputChangedError,
    MergeflowError,
    StorageIOError,
)

DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_DENIED = frozenset({errno.EACCES, errno.EPERM})


def _where(exc: OSError) -> str:
    names = [str(n) for n in (exc.filename, exc.filename2) if n]
    return " -> ".join(names) if names else "a file"


def name_written_file(exc: OSError, path: os.PathLike[str] | str) -> None:
    """A full disk met by os.write, fsync or sendfile carries no file name: name the file being written,
    so the message says which filesystem to free (not "a file")."""
    if exc.errno in DISK_FULL and not exc.filename:
        exc.filename = os.fspath(path)


def typed_os_error(exc: OSError, doing: str = "") -> MergeflowError | None:
    """The mergeflow error for `exc` (None for kinds users do not meet: those are bugs)."""
    if isinstance(exc, MergeflowError):
        return exc
    where, what = _where(exc), f" while {doing}" if doing else ""
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    if exc.errno in DISK_FULL:
        return DiskFullError(f"no space left{what} ({reason}: {where}); free space (or raise the quota or file size "
                             "limit) on that filesystem and rerun the same command to resume")
    if exc.errno in _DENIED:
        return FileAccessError(f"permission denied{what}: {where}; fix its permissions or choose another path")
    if exc.errno == errno.EROFS:
        return FileAccessError(f"read-only filesystem{what}: {where}; choose a target on a writable filesystem")
    if exc.errno == errno.ENOENT:
        return InputChangedError(f"{where} vanished{what} (removed or unmounted meanwhile); restore it and rerun")
    if exc.errno in (errno.EIO, errno.ENXIO, errno.ESTALE):
        return StorageIOError(f"{reason}{what} ({where}): the disk or network filesystem failed; rerun once it is healthy")
    return None
