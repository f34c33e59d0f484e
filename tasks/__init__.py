"""The steps of an export as Prefect tasks: thin wrappers around mergeflow's domain functions.

Each module holds the tasks of one step; none imports another. What they share lives here:
which failures are worth a retry (mergeflow.io.os_errors.is_retryable: a declared `retryable` flag or a
transient OS error; a bug is never retried).

Caching convention: only rank indexing and hashing and shard writing are cached (their cache
keys are built from file stamps). Every other task sets `cache_policy=NO_CACHE`: Prefect's default
policy hashes all task inputs on every call (seconds for the plan of a big model), and those
steps are cheap to redo.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypedDict

from mergeflow.errors import MergeflowError
from mergeflow.io.os_errors import is_retryable


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's retry condition: retry what the error hierarchy calls retryable (a failing disk, a
    reset connection), never a refusal (a full disk, a permission) and never a bug (a TypeError)."""
    try:
        state.result()
    except Exception as exc:  # noqa: BLE001 - the state's own exception, classified below
        return is_retryable(exc)
    return False


class RetryOptions(TypedDict):
    """The `@task` options of one retry policy."""

    retries: int
    retry_delay_seconds: int
    retry_condition_fn: Callable[[Any, Any, Any], bool]


# Task options of the file-reading and -writing tasks: retried on I/O hiccups (never on a refusal).
RETRY_IO: RetryOptions = {"retries": 2, "retry_delay_seconds": 1, "retry_condition_fn": retry_transient}


class ReasonFirst(logging.Filter):
    """A run that failed on a mergeflow error logs its one-line reason; the traceback only at debug level.

    Prefect logs a failed task ("Task run failed with exception: ...") and the flow it fails
    ("Encountered exception during execution: ...") with the whole traceback, which buried the
    reason on the run page. A mergeflow error's message is the reason; its traceback (Prefect's
    engine frames, mostly) stays available with PREFECT_LOGGING_LEVEL=DEBUG. Other exceptions
    are bugs: their tracebacks stay where they are.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, MergeflowError) or record.levelno <= logging.DEBUG:
            return True
        logger = logging.getLogger(record.name)
        if logger.isEnabledFor(logging.DEBUG):  # Prefect's handlers take every level: the logger's level decides
            trace = logging.makeLogRecord({**record.__dict__, "msg": "Traceback of: %s", "args": (exc,),
                                           "levelno": logging.DEBUG, "levelname": "DEBUG"})
            logger.handle(trace)
        record.msg, record.args = "Failed with %s: %s", (type(exc).__name__, exc)
        record.exc_info, record.exc_text = None, None
        return True


def install_reason_first() -> None:
    """Put ReasonFirst on Prefect's run loggers, once per process (every process that runs tasks imports this)."""
    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, ReasonFirst) for f in logger.filters):
            logger.addFilter(ReasonFirst())


install_reason_first()
