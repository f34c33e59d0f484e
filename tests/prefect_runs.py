"""Reading flow and task runs back through the Prefect client, waiting (bounded) for them to settle."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any
from uuid import UUID


async def _task_runs(flow_run_id: UUID) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    async with get_client() as client:
        return await client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))


def task_runs(flow_run_id: UUID, ready: Callable[[list[Any]], bool], timeout: float = 30.0) -> list[Any]:
    """The task runs of a flow run, once `ready(runs)` holds (task states arrive as events, a bit later)."""
    from prefect.settings import PREFECT_API_URL
    from prefect_server import NO_TASK_RUNS

    # The session's servers do not record task runs (tests/prefect_server.py): waiting on one would only time out.
    assert PREFECT_API_URL.value() not in NO_TASK_RUNS, "this server records no task runs: take prefect_events_api"
    deadline = time.monotonic() + timeout
    while True:
        runs = asyncio.run(_task_runs(flow_run_id))
        if ready(runs) or time.monotonic() > deadline:
            return runs
        time.sleep(0.5)


def shard_states(runs: list[Any], attempt: int | None = None) -> dict[str, str]:
    """write-shard task run name -> state name (of one flow-run attempt, if given)."""
    return {
        r.name: r.state.name
        for r in runs
        if r.name.startswith("write-shard-") and r.state is not None and r.state.is_final()
        and (attempt is None or r.flow_run_run_count == attempt)
    }


async def _flow_runs(name_like: str | None = None, deployment_id: UUID | None = None) -> list[Any]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterName,
    )

    flow_filter = FlowRunFilter(name=FlowRunFilterName(like_=name_like)) if name_like else None
    deployment_filter = DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id])) if deployment_id else None
    async with get_client() as client:
        return await client.read_flow_runs(flow_run_filter=flow_filter, deployment_filter=deployment_filter)


def flow_runs(name_like: str | None = None, deployment_id: UUID | None = None) -> list[Any]:
    """Flow runs whose name contains `name_like` and/or that belong to a deployment."""
    return asyncio.run(_flow_runs(name_like, deployment_id))


def latest_flow_run(name_like: str) -> Any:
    """The most recently created flow run whose name contains `name_like`."""
    return max(flow_runs(name_like=name_like), key=lambda r: r.created)


def flow_run_logs(flow_run_id: UUID, until: str, timeout: float = 30.0) -> list[str]:
    """The flow run's log messages once one contains `until` (logs reach the server in batches)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    deadline = time.monotonic() + timeout
    while True:
        with get_client(sync_client=True) as client:
            messages = [log.message for log in client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[flow_run_id])))]
        if any(until in m for m in messages) or time.monotonic() > deadline:
            return messages
        time.sleep(0.5)
