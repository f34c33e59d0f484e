"""Filesystem primitives: hashing, fsync, no-replace rename, the target lock, permissions."""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import hashlib
import os
import stat
from dataclasses import dataclass
from pathlib import Path

from mergeflow.errors import (
    ConcurrentExportError,
    FileAccessError,
    PathSafetyError,
    TargetExistsError,
)
from mergeflow.io.os_errors import DISK_FULL, typed_os_error, with_os_fields

# Measured on 2 cores: a 1 MiB buffer (it stays in L2 between read and hash) hashes a few percent
# faster than 8 MiB, and each update still releases the GIL, so threads hash files in parallel.
HASH_BLOCK = 1024 * 1024
RENAME_NOREPLACE = 1
_AT_FDCWD = -100


def sha256_file(path: Path, block: int = HASH_BLOCK) -> str:
    """sha256 of a file, read in large blocks (hashlib releases the GIL on big updates).

    An export hashes through mergeflow.io.session.sha256_file, which reuses the bytes it already read."""
    digest = hashlib.sha256()
    with open(path, "rb", buffering=0) as handle:
        if os.fstat(handle.fileno()).st_size < block:  # configs, tokenizers: one read, no zeroed buffer
            digest.update(handle.readall())
            return digest.hexdigest()
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)  # larger read-ahead when not cached
        buffer = bytearray(block)
        view = memoryview(buffer)
        while True:
            n = handle.readinto(buffer)
            if not n:
                break
            digest.update(view[:n])
    return digest.hexdigest()


@dataclass(frozen=True)
class FileStamp:
    """What identifies a file's content cheaply: used to notice inputs changing mid-export."""

    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int

    @classmethod
    def of(cls, path: Path) -> "FileStamp":
        st = os.stat(path)
        return cls(st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (new files, renames) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _renameat2() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return getattr(libc, "renameat2", None)


def rename_noreplace(src: Path, dst: Path) -> None:
    """Atomically rename src to dst, failing if dst exists (even as an empty directory).

    os.rename would silently replace an empty directory created meanwhile; renameat2 with
    RENAME_NOREPLACE lets the kernel decide, so there is no check-then-rename race.
    """
    func = _renameat2()
    if func is None:
        raise PathSafetyError("this system's C library lacks renameat2; mergeflow needs Linux with glibc >= 2.28 to publish safely")
    rc = func(_AT_FDCWD, os.fsencode(str(src)), _AT_FDCWD, os.fsencode(str(dst)), RENAME_NOREPLACE)
    if rc != 0:
        err = ctypes.get_errno()
        if err == errno.EEXIST:
            raise TargetExistsError(f"target {dst} appeared while exporting; it was left untouched and nothing was published")
        if err in (errno.EINVAL, errno.ENOSYS):
            raise PathSafetyError(f"the filesystem of {dst.parent} does not support atomic no-replace renames (renameat2: {os.strerror(err)})")
        raise OSError(err, f"renameat2 {src} -> {dst}: {os.strerror(err)}")


def make_readable(root: Path) -> None:
    """Give a published tree normal model-directory permissions (files 0644, dirs 0755).

    safetensors and save_pretrained create files with mode 0600.
    """
    for dirpath, dirnames, filenames in os.walk(root):
        os.chmod(dirpath, 0o755)
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o644)


def _cannot_create(path: Path, exc: OSError) -> Exception:
    """The lock is the first file an export creates beside its target: say why that directory cannot take one."""
    if exc.errno in DISK_FULL:
        return typed_os_error(exc, "creating the target's lock file") or exc
    return with_os_fields(FileAccessError(
        f"cannot create files in {path.parent} ({os.strerror(exc.errno or 0)}); choose a --target_dir in a writable "
        "directory of a regular filesystem (not /proc or /sys)"), exc)


class TargetLock:
    """An exclusive flock beside the target: two exports of one target never overlap.

    The lock file is unlinked on release; an acquirer re-checks that the path still names
    the inode it locked, so a lock file removed by a finishing export is never trusted.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None

    def acquire(self) -> "TargetLock":
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as exc:
                raise _cannot_create(self.path, exc) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise ConcurrentExportError(
                    f"another mergeflow export to the same target is running (lock {self.path.name}); "
                    "wait for it to finish"
                ) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(self.path).st_ino
            except FileNotFoundError:
                same = False
            if same:
                # A killed holder leaves its pid behind (the kernel drops its flock, not the file).
                try:
                    os.ftruncate(fd, 0)
                    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
                except OSError:
                    # A full disk: no lock file may stay behind a refusal.
                    self._fd = fd
                    self.release()
                    raise
                self._fd = fd
                return self
            os.close(fd)

    def release(self) -> None:
        if self._fd is None:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        os.close(self._fd)
        self._fd = None

    def __enter__(self) -> "TargetLock":
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


def is_plain_file(path: Path) -> bool:
    """True for a regular file that is not a symlink."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False
