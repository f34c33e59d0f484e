"""What every task module shares: which failures are worth a retry.

Caching convention: only rank indexing and hashing and shard writing are cached (their cache
keys are built from file stamps). Every other task sets `cache_policy=NO_CACHE`: Prefect's default
policy hashes all task inputs on every call (seconds for the plan of a big model), and those
steps are cheap to redo.
"""

from __future__ import annotations

from typing import Any

from mergeflow.errors import MergeflowError


def retry_transient(task: Any, task_run: Any, state: Any) -> bool:
    """Retry I/O hiccups; never retry a refusal (bad input stays bad on the next try)."""
    try:
        state.result()
    except MergeflowError:
        return False
    except Exception:
        return True
    return False


# Task options of the file-reading and -writing tasks: retried on I/O hiccups (never on a refusal).
RETRY_IO: dict[str, Any] = {"retries": 2, "retry_delay_seconds": 1, "retry_condition_fn": retry_transient}
