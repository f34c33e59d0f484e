"""What every task module shares: which failures are worth a retry."""

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
