"""The merge flow's domain glue that must run in the flow's own process, so that flows/merge.py reads as the steps.

The target lock is held by the process that runs the flow (a task may run in a Dask worker); a failure
under it is settled (the staging kept for a resume and named, or removed) before the lock is released;
what a killed run left is cleared, and other staging dirs of the target are named, where the command's
user sees them (the CLI shows no run logs); the checkpoint's caches are forgotten when the export ends.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from prefect import get_run_logger

from mergeflow.errors import MergeflowError, one_line
from mergeflow.flows.progress import route_write
from mergeflow.io.fs import TargetLock
from mergeflow.io.interrupt import request_stop
from mergeflow.io.os_errors import typed_os_error
from mergeflow.io.session import current_session, enter_session
from mergeflow.io.staging import (
    check_target,
    orphans_of,
    remove_partial_writes,
    settle_failed_staging,
)
from mergeflow.records import MergePlan
from mergeflow.sources.base import Indexing
from mergeflow.sources.registry import source_named


@contextmanager
def typed_os_errors() -> Iterator[None]:
    """An OSError (disk full, permissions, ...) leaves as the typed mergeflow error of one line, when there is one."""
    try:
        yield
    except OSError as exc:
        typed = typed_os_error(exc)
        if typed is None:
            raise
        raise typed from None


@contextmanager
def target_locked(plan: MergePlan) -> Iterator[None]:
    """Hold the target's lock for the export's steps; a failure settles the staging dir before the lock goes."""
    lock = TargetLock(Path(plan.output.lock)).acquire()
    try:
        yield
    except (MergeflowError, OSError) as exc:
        typed = typed_os_error(exc) if isinstance(exc, OSError) else exc  # disk full, permissions, ...: one line
        if typed is None:
            raise
        raise settle_failed_staging(typed, Path(plan.output.staging)) from None
    except BaseException as exc:
        # A SIGTERM inside a flow run reaches Prefect's handler, not ours (its engine installs its own
        # for the run, which also serves a cancel from the UI): its TerminationSignal unwinds only this
        # thread, so the writer threads are told here, before the engine waits for them. Only signals
        # (BaseException, not Exception): an ordinary failure must not stop this process's next export.
        if not isinstance(exc, Exception):
            request_stop()
        raise
    finally:
        lock.release()


def prepare_staging(plan: MergePlan) -> None:
    """Under the lock: the target is still free, a killed run's temporary files are gone, other staging dirs named."""
    logger = get_run_logger()
    check_target(Path(plan.output.target))  # re-checked under the lock: another export may have finished
    left = remove_partial_writes(Path(plan.output.staging))  # a killed run's temporary files: never resumed
    if left:
        logger.info("Removed %d temporary file(s) a killed run left: %s", len(left), ", ".join(left[:5]))
    others = orphans_of(Path(plan.output.target), Path(plan.output.staging))
    if others:  # another input, option or (before keys were resolved) spelling of this export: resumed by nothing
        note = (f"staging dir(s) of this target that this export does not resume: {', '.join(map(str, others))}; "
                "`mergeflow staging clean` removes them")
        logger.warning(note[0].upper() + note[1:])
        print(f"mergeflow: note: {one_line(note)}", file=sys.stderr)  # the CLI shows no run logs


def enter_export_session() -> Callable[[], None]:
    """This export's state (digest prefetch, parsed checkpoint metadata, files read): the CLI's session when it
    planned the pre-flight in this process, else a new one; returns what ends it. Nothing process-wide to clear.

    Its shard writes are routed to this run's progress for as long as the run lasts, ahead of any listener a
    caller added to the session: that one hears of each tensor after the run has counted it."""
    leave = enter_session()
    session = current_session()
    session.writes.add(route_write, first=True)

    def end() -> None:
        session.writes.remove(route_write)
        leave()

    return end


def indexed_by_metadata(plan: MergePlan) -> bool:
    """Whether the checkpoint's own metadata indexes it (a DCP's `.metadata`), else each rank file is indexed."""
    return source_named(plan.checkpoint.format).indexing is Indexing.METADATA


def index_units(plan: MergePlan) -> int:
    """How many rank-file index tasks the checkpoint takes."""
    return source_named(plan.checkpoint.format).index_units(plan.checkpoint)


def indexed_note(plan: MergePlan, count: int) -> str:
    """The log line once the checkpoint is indexed, in its source's words."""
    return source_named(plan.checkpoint.format).indexed_note(plan.checkpoint, count)
