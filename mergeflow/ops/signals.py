"""Ctrl-C and SIGTERM for the command line: one stop, one line, exit 130/143, never an abort.

The first SIGINT or SIGTERM asks every write loop to stop (mergeflow.io.interrupt) and raises
one `Interrupted` in the main thread, which unwinds the flow (Prefect marks the run crashed).
Later signals only repeat the request: a second exception raised into the middle of the
cleanup is what used to abort the process ("terminate called without an active exception").
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType

from mergeflow.io.interrupt import clear_stop, request_stop, stop_requested
from mergeflow.io.staging import staging_dirs_of

# Exit status of a process ended by a signal, as shells report it: 128 + signal number.
EXIT_STATUS = {signal.SIGINT: 130, signal.SIGTERM: 143}
# After the line is printed, normal interpreter exit (worker threads, Prefect's final sends)
# gets this long before the process ends itself.
EXIT_GRACE_S = 10.0


class Interrupted(KeyboardInterrupt):
    """The first SIGINT or SIGTERM; a KeyboardInterrupt, so every layer unwinds as for Ctrl-C."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


_received: list[int] = []  # the signals this process got, first first


def _on_signal(signum: int, frame: FrameType | None) -> None:
    _received.append(signum)
    if len(_received) > 1:
        return  # already stopping: never a second exception in the middle of the cleanup
    # The stop may be requested already: a SIGTERM during a flow run reaches Prefect's handler first
    # (flows/merge.py then stops the writers), and Prefect sends it again to this one as it unwinds.
    request_stop()
    raise Interrupted(signum)


@contextmanager
def interrupts_stop_the_export() -> Iterator[None]:
    """Install the handlers for the duration of a command (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    clear_stop()
    _received.clear()
    previous = {sig: signal.signal(sig, _on_signal) for sig in EXIT_STATUS}
    try:
        yield
    finally:
        if not stop_requested():  # once stopping, Python's default handler must not come back for the exit
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def first_signal(exc: BaseException | None = None) -> int | None:
    """The signal that stopped this command: the exception's, else the first one received."""
    if isinstance(exc, Interrupted):
        return exc.signum
    if _received:
        return _received[0]
    return signal.SIGINT if isinstance(exc, KeyboardInterrupt) else None


def exit_status_of(signum: int) -> int:
    return EXIT_STATUS.get(signal.Signals(signum), 128 + signum)


def kept_staging(target_dir: str | None) -> list[Path]:
    """The staging directories kept beside `target_dir` (what a rerun resumes)."""
    return staging_dirs_of(Path(target_dir)) if target_dir else []


def interrupted_line(signum: int, target_dir: str | None) -> str:
    name = signal.Signals(signum).name
    kept = kept_staging(target_dir)
    where = f"; work kept for resume in {kept[-1]} (rerun the same command to resume)" if kept else ""
    return f"mergeflow: interrupted ({name}); nothing was published{where}"


def end_soon(status: int, api_answers: Callable[[], bool]) -> None:
    """Called once the line is printed: the process ends with `status`, quickly and silently.

    `api_answers` says whether the Prefect API (if one was used) still answers. Where it does, the normal exit sends what is queued (the UI keeps the
    run's last logs), within EXIT_GRACE_S. Where it does not (Prefect's temporary per-command
    server is in the command's process group and died with the Ctrl-C), nothing queued can be
    delivered: waiting for Prefect's retries only printed their errors after the line, for 10 s.
    """
    for sig in EXIT_STATUS:
        signal.signal(sig, signal.SIG_IGN)  # the line is printed; more Ctrl-C changes nothing
    # After the one line, no more console output: Prefect's services report failed sends at ERROR.
    logging.disable(logging.ERROR)
    if not api_answers():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    timer = threading.Timer(EXIT_GRACE_S, os._exit, (status,))
    timer.daemon = True
    timer.start()
    # Registered last, so run first at exit: it runs the other exit hooks itself (Prefect's final
    # sends, the per-command server's stop), then ends the process without the interpreter's
    # teardown, whose garbage collection of torch's and Prefect's objects took 2-4 s here after an
    # interrupted export, for nothing: nothing is written or sent then.
    atexit.register(_exit_after_the_exit_hooks, status)


def _exit_after_the_exit_hooks(status: int) -> None:
    atexit.unregister(_exit_after_the_exit_hooks)
    atexit._run_exitfuncs()  # the remaining hooks, last registered first, as the interpreter runs them
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe: nothing more to say anyway
            stream.flush()
    os._exit(status)
