"""Test hooks that fail the process at its Nth durable write: kill -9, or a full disk, at every write site.

`MERGEFLOW_FAULT_KILL_AT_WRITE=N` makes the Nth call of `durable_write_point` (counted per
process, in the order the writes happen) send SIGKILL to the process, after the new bytes are
on disk under their temporary name and before they are renamed into place: the moment a crash
hurts most. `MERGEFLOW_FAULT_FULL_AT_WRITE=N` makes that write fail as a full disk does
(OSError ENOSPC naming the file), leaving its temporary file behind as a real one would.
`N:TEXT` counts only the writes whose path contains TEXT: the Nth write of one stage.
Without the variables this is two environment lookups per file written.
"""

from __future__ import annotations

import errno
import os
import signal

_KILL_ENV = "MERGEFLOW_FAULT_KILL_AT_WRITE"
_FULL_ENV = "MERGEFLOW_FAULT_FULL_AT_WRITE"
# Counted per setting: a test that sets a new N in the same process starts again from 1.
_seen: dict[tuple[str, str], int] = {}


def _hit(env: str, path: str) -> bool:
    """Whether this write is the Nth; `N:TEXT` counts only writes whose path contains TEXT (one stage)."""
    target = os.environ.get(env)
    if not target:
        return False
    count, _, within = target.partition(":")
    if within and within not in path:
        return False
    key = (env, target)
    _seen[key] = _seen.get(key, 0) + 1
    return _seen[key] == int(count)


def durable_write_point(path: os.PathLike[str] | str | None = None) -> None:
    """Called by every durable write just before its rename (`path`: the file being written)."""
    where = os.fspath(path) if path is not None else ""
    if _hit(_KILL_ENV, where):
        os.kill(os.getpid(), signal.SIGKILL)
    if _hit(_FULL_ENV, where):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path) if path is not None else None)


_PUBLISH_ENV = "MERGEFLOW_FAULT_KILL_AFTER_PUBLISH"
PUBLISH_POINTS = ("renamed", "synced", "staging-removed")


def publish_point(stage: str) -> None:
    """Called at each step after the publish rename; `MERGEFLOW_FAULT_KILL_AFTER_PUBLISH=<stage>` kills there."""
    if os.environ.get(_PUBLISH_ENV) == stage:
        os.kill(os.getpid(), signal.SIGKILL)
