"""The task-run timeline of a flow run, as the Prefect server recorded it.

    python bench/timeline.py [FLOW_RUN_NAME]     # default: the latest flow run

Prints every task run's start and end relative to the flow run's start, and a per-task-name
summary (count, summed and wall seconds), so a regression shows which step it came from.
"""

from __future__ import annotations

import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Span:
    name: str
    start: float
    end: float


def flow_timeline(flow_run_name: str | None = None) -> tuple[Any, list[Span]]:
    """(flow run, task spans relative to the flow run's start) of the named or latest flow run."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterName,
        TaskRunFilter,
        TaskRunFilterFlowRunId,
    )
    from prefect.client.schemas.sorting import FlowRunSort, TaskRunSort

    with get_client(sync_client=True) as client:
        flow_filter = FlowRunFilter(name=FlowRunFilterName(any_=[flow_run_name])) if flow_run_name else None
        runs = client.read_flow_runs(flow_run_filter=flow_filter, sort=FlowRunSort.START_TIME_DESC, limit=1)
        if not runs:
            raise SystemExit(f"no flow run named {flow_run_name!r}")
        run = runs[0]
        tasks = client.read_task_runs(task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[run.id])),
                                      sort=TaskRunSort.EXPECTED_START_TIME_ASC, limit=200)
    origin = run.start_time
    spans = [Span(t.name, (t.start_time - origin).total_seconds(), (t.end_time - origin).total_seconds())
             for t in tasks if t.start_time is not None and t.end_time is not None]
    return run, sorted(spans, key=lambda s: s.start)


def step_of(task_run_name: str) -> str:
    """`write-shard-00002` -> `write-shard`: task runs of one step share a name up to their index."""
    head, _, tail = task_run_name.rpartition("-")
    return head if tail.isdigit() and head else task_run_name


def summarise(spans: list[Span]) -> list[tuple[str, int, float, float, float]]:
    """Per step: (step, task runs, first start, last end, summed task seconds), in start order."""
    groups: dict[str, list[Span]] = defaultdict(list)
    for span in spans:
        groups[step_of(span.name)].append(span)
    rows = [(step, len(g), min(s.start for s in g), max(s.end for s in g), sum(s.end - s.start for s in g))
            for step, g in groups.items()]
    return sorted(rows, key=lambda r: r[2])


def main() -> int:
    run, spans = flow_timeline(sys.argv[1] if len(sys.argv) > 1 else None)
    total = (run.end_time - run.start_time).total_seconds() if run.end_time else float("nan")
    print(f"flow run {run.name}: {run.state_name}, {total:.2f} s in flow")
    for span in spans:
        print(f"  {span.start:7.2f} - {span.end:7.2f}  {span.name}")
    print(f"{'step':<24} {'runs':>4} {'from':>7} {'to':>7} {'task_s':>7}")
    for step, count, first, last, summed in summarise(spans):
        print(f"{step:<24} {count:>4} {first:>7.2f} {last:>7.2f} {summed:>7.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
