"""Faults injected from outside mergeflow, at the syscalls of its durable writes and of its publish.

mergeflow carries no test hooks. Each of its durable writes (io/jsonfiles.py, the base-file copies,
the shard writer) writes the new bytes under a temporary name, fsyncs that file, then renames it
into place; the publish renames the staged tree into place, fsyncs the target's directory and
removes the staging dir. These injectors wrap the `os` functions those syscalls go through
(os.fsync, os.replace/os.rename, os.open, os.rmdir), in the process that runs the export, and
change nothing else:

- `KillAtWrite(n, within)`: SIGKILL at the Nth durable write, that is the Nth rename of a regular
  file this process fsynced, just before the rename: the new bytes are on disk under their
  temporary name and not yet in place, the moment a crash hurts most.
- `FullAtWrite(n, within)`: the fsync of the Nth regular file written fails with ENOSPC, as a full
  disk's does; its temporary file stays behind, as a real one would.
- `KillAfterPublish(stage, target)`: SIGKILL after the publish rename of `target`: `renamed` (just
  before its directory's fsync), `synced` (just after it) or `staging-removed` (just after the
  staging dir's last rmdir).

`within=TEXT` counts only the writes whose file names contain TEXT (one stage): for a kill, the
name the file is renamed to; for ENOSPC, the temporary file's name or that of the file its thread
opened read-only (os.open) last before it: the file it is a copy of (the base's files are copied
under a hashed temporary name, each opened so just before its copy is written).

In this process: `with FullAtWrite(3): merge_model(...)`. As a command, forked by `forked_cli` like
any script in tests/ (or started cold where forking is not faithful), through `mergeflow(...)`:
`python tests/syscall_faults.py --kill-at-write N[:TEXT] -- ARGS`, `--full-at-write N[:TEXT]` or
`--kill-after-publish STAGE --target PATH`: the mergeflow command line with that fault.
"""

from __future__ import annotations

import argparse
import errno
import os
import signal
import stat
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, Self

PUBLISH_STAGES = ("renamed", "synced", "staging-removed")


def _fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _Injector:
    """Wraps some os functions while active; `seen` counts the writes that matched (a retry shows as more)."""

    def __init__(self, count: int = 1, within: str = "") -> None:
        self.count = count
        self.within = within
        self.seen = 0
        self._lock = threading.Lock()
        self._inner: dict[str, Callable[..., Any]] = {}  # what each wrapped os function was: the call goes on there

    def _wrappers(self) -> dict[str, Callable[..., Any]]:
        raise NotImplementedError

    def _hit(self, name: str) -> bool:
        """Whether this matching write is the Nth (counted in the order the writes reach their syscall)."""
        if self.within and self.within not in name:
            return False
        with self._lock:
            self.seen += 1
            return self.seen == self.count

    def __enter__(self) -> Self:
        for name, wrapper in self._wrappers().items():
            self._inner[name] = getattr(os, name)
            setattr(os, name, wrapper)
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        for name, inner in self._inner.items():
            setattr(os, name, inner)
        self._inner.clear()


class KillAtWrite(_Injector):
    """SIGKILL just before the rename of the Nth durable write (a regular file this process fsynced)."""

    def __init__(self, count: int = 1, within: str = "") -> None:
        super().__init__(count, within)
        self._synced: set[tuple[int, int]] = set()

    def _wrappers(self) -> dict[str, Callable[..., Any]]:
        def fsync(fd: Any) -> None:
            self._inner["fsync"](fd)
            st = os.fstat(fd if isinstance(fd, int) else fd.fileno())
            if stat.S_ISREG(st.st_mode):
                with self._lock:
                    self._synced.add(_identity(st))

        def renamer(name: str) -> Callable[..., None]:
            def rename(src: Any, dst: Any, **kwargs: Any) -> None:
                try:
                    durable = _identity(os.stat(src, dir_fd=kwargs.get("src_dir_fd"))) in self._synced
                except OSError:
                    durable = False
                if durable and self._hit(os.fsdecode(dst)):
                    _kill_self()
                self._inner[name](src, dst, **kwargs)
            return rename

        return {"fsync": fsync, "replace": renamer("replace"), "rename": renamer("rename")}


class FullAtWrite(_Injector):
    """The fsync of the Nth regular file written fails with ENOSPC, leaving the file behind."""

    def __init__(self, count: int = 1, within: str = "") -> None:
        super().__init__(count, within)
        self.failed = ""  # the file whose fsync failed
        self._read = threading.local()  # .path: the file this thread last opened for reading (what it copies)

    def _wrappers(self) -> dict[str, Callable[..., Any]]:
        def open_(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
            fd = self._inner["open"](path, flags, *args, **kwargs)
            if flags & os.O_ACCMODE == os.O_RDONLY and not flags & os.O_DIRECTORY:
                self._read.path = _fd_path(fd)
            return fd

        def fsync(fd: Any) -> None:
            fd = fd if isinstance(fd, int) else fd.fileno()
            if stat.S_ISREG(os.fstat(fd).st_mode):
                source, self._read.path = getattr(self._read, "path", ""), ""
                if self._hit(f"{_fd_path(fd)}\0{source}"):
                    self.failed = _fd_path(fd)
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))  # as the kernel's: it names no file
            self._inner["fsync"](fd)

        return {"open": open_, "fsync": fsync}


class KillAfterPublish(_Injector):
    """SIGKILL at one step after the rename that publishes `target` (see PUBLISH_STAGES)."""

    def __init__(self, stage: str, target: Path) -> None:
        if stage not in PUBLISH_STAGES:
            raise ValueError(f"stage {stage!r} is not one of {PUBLISH_STAGES}")
        super().__init__()
        self.stage = stage
        self.target = Path(os.path.realpath(target))

    def _published(self) -> bool:
        return os.path.lexists(self.target)

    def _wrappers(self) -> dict[str, Callable[..., Any]]:
        def fsync(fd: Any) -> None:
            st = os.fstat(fd if isinstance(fd, int) else fd.fileno())
            parent = stat.S_ISDIR(st.st_mode) and self._published() and os.path.samestat(st, os.stat(self.target.parent))
            if parent and self.stage == "renamed":
                _kill_self()
            self._inner["fsync"](fd)
            if parent and self.stage == "synced":
                _kill_self()

        def rmdir(path: Any, *, dir_fd: int | None = None) -> None:
            self._inner["rmdir"](path, dir_fd=dir_fd)
            full = Path(os.path.realpath(os.fsdecode(path))) if dir_fd is None else None
            if full is not None and full.parent == self.target.parent \
                    and full.name.startswith(f".{self.target.name}.mergeflow-staging-") and self._published():
                _kill_self()

        return {"rmdir": rmdir} if self.stage == "staging-removed" else {"fsync": fsync}


def mergeflow(fault: list[str], args: list[str], env: dict[str, str],
              timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`python -m mergeflow ARGS` with one fault (say `["--kill-at-write", "3"]`), forked like any command."""
    import forked_cli

    return forked_cli.run([str(Path(__file__).resolve()), *fault, "--", *args], env, timeout=timeout)


def _count(spec: str) -> tuple[int, str]:
    count, _, within = spec.partition(":")
    return int(count), within


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="syscall_faults.py", description="mergeflow's command line with one fault")
    fault = parser.add_mutually_exclusive_group(required=True)
    fault.add_argument("--kill-at-write", metavar="N[:TEXT]")
    fault.add_argument("--full-at-write", metavar="N[:TEXT]")
    fault.add_argument("--kill-after-publish", choices=PUBLISH_STAGES)
    parser.add_argument("--target", type=Path, help="the target whose publish --kill-after-publish interrupts")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="-- then the mergeflow command line")
    options = parser.parse_args(argv)
    args = options.args[1:] if options.args[:1] == ["--"] else options.args
    injector: _Injector
    if options.kill_at_write:
        injector = KillAtWrite(*_count(options.kill_at_write))
    elif options.full_at_write:
        injector = FullAtWrite(*_count(options.full_at_write))
    else:
        if options.target is None:
            parser.error("--kill-after-publish needs --target")
        injector = KillAfterPublish(options.kill_after_publish, options.target)
    from mergeflow.flows.cli import main as mergeflow_main

    with injector:
        return mergeflow_main(args)


if __name__ == "__main__":
    sys.path[0] = os.getcwd()  # as under `python -m mergeflow`: this file's directory is not on the path
    raise SystemExit(main(sys.argv[1:]))
