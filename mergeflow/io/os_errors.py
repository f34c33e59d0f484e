"""The operating system's refusals users meet, as mergeflow errors that say what to do.

Disk full, quota, file size limit, permission denied, read-only filesystem, a path that
vanished, a failing disk: each is one line naming the path and the fix, with the exit
status of a refusal. Anything else stays an internal error with its traceback under --debug.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path
from typing import TypeVar

from mergeflow.errors import (
    DiskFullError,
    FileAccessError,
    InputChangedError,
    MergeflowError,
    StorageIOError,
)

_Typed = TypeVar("_Typed", bound=MergeflowError)

DISK_FULL = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})
_DENIED = frozenset({errno.EACCES, errno.EPERM})
# The disk or the network filesystem failed (a bad sector, an unplugged device, an NFS handle gone
# stale across a server restart): typed as StorageIOError, which a retry may get past.
_STORAGE_FAILED = frozenset({errno.EIO, errno.ENXIO, errno.ESTALE})
# Conditions that pass by themselves: a busy resource, an interrupted call, a connection reset or
# timed out. Not typed for users (they rarely outlast the retries) but retried. A full disk, a
# permission, a read-only mount or a vanished path is not here: those wait for a person.
_TRANSIENT = _STORAGE_FAILED | frozenset({
    errno.EAGAIN, errno.EWOULDBLOCK, errno.EINTR, errno.EBUSY, errno.ETIMEDOUT,
    errno.ECONNRESET, errno.ECONNABORTED,
})
# The same conditions raised as OSError subclasses without an errno (`TimeoutError()`, as asyncio does).
_TRANSIENT_TYPES = (BlockingIOError, InterruptedError, TimeoutError, ConnectionResetError, ConnectionAbortedError)


def _where(exc: OSError) -> str:
    names = [str(n) for n in (exc.filename, exc.filename2) if n]
    return " -> ".join(names) if names else "a file"


def name_written_file(exc: OSError, path: os.PathLike[str] | str) -> None:
    """A full disk met by os.write, fsync or sendfile carries no file name: name the file being written,
    so the message says which filesystem to free (not "a file")."""
    if exc.errno in DISK_FULL and not exc.filename and not isinstance(exc, MergeflowError):  # typed: named already
        exc.filename = os.fspath(path)


def typed_os_error(exc: OSError, doing: str = "") -> MergeflowError | None:
    """The mergeflow error for `exc` (None for kinds users do not meet: those are bugs), with its errno and file names."""
    if isinstance(exc, MergeflowError):
        return exc
    typed = _typed(exc, doing)
    return with_os_fields(typed, exc) if typed is not None else None


def with_os_fields(typed: _Typed, exc: OSError) -> _Typed:
    """`typed`, carrying `exc`'s errno and file names when it is an OSError itself (code reading them still can)."""
    if isinstance(typed, OSError):
        typed.errno, typed.filename, typed.filename2 = exc.errno, exc.filename, exc.filename2
    return typed


def is_transient(exc: OSError) -> bool:
    """Whether another attempt may get past `exc`: a typed error says so itself (a failing disk yes,
    a full disk or a permission no); otherwise only a condition that passes by itself (`_TRANSIENT`)."""
    typed = typed_os_error(exc)
    if typed is not None:
        return typed.retryable
    return exc.errno in _TRANSIENT or (exc.errno is None and isinstance(exc, _TRANSIENT_TYPES))


def _typed(exc: OSError, doing: str) -> MergeflowError | None:
    where, what = _where(exc), f" while {doing}" if doing else ""
    reason = os.strerror(exc.errno) if exc.errno else str(exc)
    if exc.errno in DISK_FULL:
        return DiskFullError(f"no space left{what} ({reason}: {where}); free space (or raise the quota or file size "
                             "limit) on that filesystem and rerun the same command to resume")
    if exc.errno in _DENIED or exc.errno == errno.EROFS:
        kind = "read-only filesystem" if exc.errno == errno.EROFS else "permission denied"
        home = _under_prefect_home(exc)
        if home is not None:  # Prefect's own files: the target is not to blame
            return FileAccessError(f"{kind}{what}: {where} is in PREFECT_HOME ({home}); "
                                   "set PREFECT_HOME to a writable directory")
    if exc.errno in _DENIED:
        return FileAccessError(f"permission denied{what}: {where}; fix its permissions or choose another path")
    if exc.errno == errno.EROFS:
        return FileAccessError(f"read-only filesystem{what}: {where}; choose a target on a writable filesystem")
    if exc.errno == errno.ENOENT:
        return InputChangedError(f"{where} vanished{what} (removed or unmounted meanwhile); restore it and rerun")
    if exc.errno in _STORAGE_FAILED:
        return StorageIOError(f"{reason}{what} ({where}): the disk or network filesystem failed; rerun once it is healthy")
    return None


def _under_prefect_home(exc: OSError) -> Path | None:
    """PREFECT_HOME (as Prefect resolves it) when the failing path lies in it, else None."""
    home = Path(os.environ.get("PREFECT_HOME") or "~/.prefect").expanduser().absolute()
    names = [Path(os.fsdecode(n)).expanduser().absolute() for n in (exc.filename, exc.filename2)
             if isinstance(n, (str, bytes, os.PathLike))]
    return home if any(n == home or home in n.parents for n in names) else None


def unwritable_dir_reason(directory: Path) -> str | None:
    """Why files cannot be created in `directory` ("read-only filesystem", "permission denied"); None if they can.

    Asked before any work, so a refusal costs a `statvfs` instead of a run that fails at its first
    write. The mount flag is read separately because root ignores mode bits but not a read-only mount.
    """
    try:
        if os.statvfs(directory).f_flag & os.ST_RDONLY:
            return "read-only filesystem"
    except OSError:
        return None  # cannot tell (it vanished, or an exotic filesystem): the first write will say
    if not os.access(directory, os.W_OK | os.X_OK):
        return "permission denied"
    return None


def check_target_parent(target: Path) -> None:
    """Refuse a --target_dir whose parent exists but cannot take new files (the flow's staging would fail)."""
    target = Path(target).expanduser()
    parent = target.parent.resolve()
    # An existing target or a missing parent: check_target's own refusal says it better.
    reason = unwritable_dir_reason(parent) if parent.is_dir() and not (parent / target.name).exists() else None
    if reason and parent.parts[:2] in (("/", "proc"), ("/", "sys")):
        raise FileAccessError(f"cannot create files in {parent} ({reason}); choose a --target_dir in a writable "
                              "directory of a regular filesystem (not /proc or /sys)")
    if reason == "read-only filesystem":
        raise FileAccessError(f"read-only filesystem: {parent} (the parent of --target_dir); "
                              "choose a target on a writable filesystem")
    if reason:
        raise FileAccessError(f"permission denied: {parent} (the parent of --target_dir) is not writable; "
                              "fix its permissions or choose another --target_dir")


def check_prefect_home(home: Path) -> None:
    """Refuse a PREFECT_HOME Prefect cannot use (its database, settings and the local server's state live there).

    Named as PREFECT_HOME, so that a read-only or misplaced one is never mistaken for a bad target.
    """
    fix = "set PREFECT_HOME to a writable directory (or unset it to use ~/.prefect)"
    if home.exists() and not home.is_dir():
        raise FileAccessError(f"PREFECT_HOME {home} is not a directory; {fix}")
    existing = next((p for p in (home, *home.parents) if p.exists()), None)
    if existing is None or not existing.is_dir():
        raise FileAccessError(f"PREFECT_HOME {home} cannot be created ({existing} is not a directory); {fix}")
    reason = unwritable_dir_reason(existing)
    if reason:
        where = "" if existing == home else f" (it does not exist, and cannot be created in {existing})"
        raise FileAccessError(f"PREFECT_HOME {home} is unusable: {reason}{where}; {fix}")


def is_retryable(exc: BaseException) -> bool:
    """Whether another attempt may succeed: only what says so. Our errors declare it; an OSError
    is retried when it is transient (is_transient). Anything else (a TypeError,
    a KeyError, a failed assert) is a bug, and a second run of a bug only fails again, later."""
    if isinstance(exc, MergeflowError):
        return exc.retryable
    if isinstance(exc, OSError):
        return is_transient(exc)
    return False
