"""The process-wide stop request a Ctrl-C or SIGTERM sets, and the checks long write loops make.

A signal reaches only the main thread; the shard writers and copiers run in worker threads
and would go on writing gigabytes nobody will publish while the process waits for them at
exit. They check this flag between tensors and files and end with ExportInterruptedError,
keeping everything already written (and verified) for a resume.
"""

from __future__ import annotations

import threading

from mergeflow.errors import ExportInterruptedError

_STOP = threading.Event()


def request_stop() -> None:
    """Ask every write loop of this process to stop at its next check."""
    _STOP.set()


def clear_stop() -> None:
    """A new command in the same process (the Python API, tests) starts without an old request."""
    _STOP.clear()


def stop_requested() -> bool:
    return _STOP.is_set()


def raise_if_stopped() -> None:
    """Called between units of work (a tensor, a file): ExportInterruptedError once a stop was requested."""
    if _STOP.is_set():
        raise ExportInterruptedError("the export was interrupted")
