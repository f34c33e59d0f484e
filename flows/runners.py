"""Which Prefect task runner runs the rank and shard tasks: threads here, or a Dask cluster."""

from __future__ import annotations

from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from mergeflow.config import DEFAULT_TASK_RUNNER, DEFAULT_WORKERS, TASK_RUNNERS
from mergeflow.errors import UsageError


def make_task_runner(kind: str = DEFAULT_TASK_RUNNER, *, workers: int = DEFAULT_WORKERS, dask_address: str | None = None) -> TaskRunner:
    """A thread pool of `workers`, or prefect-dask's runner on the cluster at `dask_address`.

    Without an address the Dask runner starts a temporary local cluster of `workers`
    single-threaded processes. Dask workers must see the same filesystem paths as this
    process (checkpoint, base, target and Prefect's result storage).
    """
    if kind not in TASK_RUNNERS:
        raise UsageError(f"--task-runner must be one of {', '.join(TASK_RUNNERS)}, not {kind!r}")
    if kind == "thread":
        if dask_address:
            raise UsageError("--dask-address needs --task-runner dask")
        return ThreadPoolTaskRunner(max_workers=workers)
    from prefect_dask import DaskTaskRunner

    if dask_address:
        return DaskTaskRunner(address=dask_address)
    return DaskTaskRunner(cluster_kwargs={"n_workers": workers, "threads_per_worker": 1, "processes": True})
