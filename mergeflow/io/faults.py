"""A test hook that stops the process dead at its Nth durable write: kill -9 at every write site.

`MERGEFLOW_FAULT_KILL_AT_WRITE=N` makes the Nth call of `durable_write_point` (counted per
process, in the order the writes happen) send SIGKILL to the process, after the new bytes are
on disk under their temporary name and before they are renamed into place: the moment a crash
hurts most. Without the variable this is one environment lookup per file written.
"""

from __future__ import annotations

import itertools
import os
import signal

_ENV = "MERGEFLOW_FAULT_KILL_AT_WRITE"
_counter = itertools.count(1)


def durable_write_point() -> None:
    """Called by every durable write just before its rename."""
    target = os.environ.get(_ENV)
    if target and next(_counter) == int(target):
        os.kill(os.getpid(), signal.SIGKILL)
