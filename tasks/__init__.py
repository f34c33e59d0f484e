"""The steps of an export as Prefect tasks: thin wrappers around mergeflow's domain functions.

Each module holds the tasks of one step; none imports another. What they share lives here:
which failures are worth a retry (read from the error's `retryable` flag).

Caching convention: only rank indexing and hashing and shard writing are cached (their cache
keys are built from file stamps). Every other task sets `cache_policy=NO_CACHE`: Prefect's default
policy hashes all task inputs on every call (seconds for the plan of a big model), and those
steps are cheap to redo.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypedDict

from mergeflow.errors import is_retryable
from mergeflow.io.os_errors import typed_os_error


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect's retry condition: retry what the error hierarchy calls retryable, never a refusal."""
    try:
        state.result()
    except Exception as exc:  # noqa: BLE001 - the state's own exception, classified below
        if isinstance(exc, OSError):  # a full disk or a permission does not heal in a second: only EIO & co. do
            exc = typed_os_error(exc) or exc
        return is_retryable(exc)
    return False


class RetryOptions(TypedDict):
    """The `@task` options of one retry policy."""

    retries: int
    retry_delay_seconds: int
    retry_condition_fn: Callable[[Any, Any, Any], bool]


# Task options of the file-reading and -writing tasks: retried on I/O hiccups (never on a refusal).
RETRY_IO: RetryOptions = {"retries": 2, "retry_delay_seconds": 1, "retry_condition_fn": retry_transient}
