"""`mergeflow serve`'s console feed: one line per served flow run started and per run finished.

Prefect's runner says nothing an operator can read when a triggered run starts or ends, and a
state hook would only run inside the flow run (not for a crash, nor for a run that never
started). So the serving process polls the API for its deployments' runs and prints the
transitions: `run_lines` is the plain function, `RunFeed` the thread that feeds it.
"""

from __future__ import annotations

import contextvars
import sys
import threading
from collections.abc import Iterable
from typing import TextIO
from uuid import UUID

from prefect.client.schemas.objects import FlowRun, StateType

POLL_SECONDS = 2.0
FINAL = {StateType.COMPLETED, StateType.FAILED, StateType.CRASHED, StateType.CANCELLED}


def run_lines(seen: dict[UUID, StateType | None], runs: Iterable[FlowRun]) -> list[str]:
    """The lines for runs that started or finished since `seen` (which is updated in place).

    A run seen for the first time already finished (it ran between two polls) gets both lines.
    """
    lines: list[str] = []
    for run in sorted(runs, key=lambda r: (r.created is None, r.created)):
        state, before = run.state_type, seen.get(run.id)
        started = state == StateType.RUNNING or state in FINAL
        if started and before != StateType.RUNNING and before not in FINAL:
            lines.append(f"mergeflow serve: started {run.name} ({run.id})")
        if state in FINAL and before not in FINAL:
            seconds = f" in {run.total_run_time.total_seconds():.1f} s" if run.total_run_time else ""
            message = f": {run.state.message}" if run.state is not None and run.state.message and state != StateType.COMPLETED else ""
            lines.append(f"mergeflow serve: {run.name} {run.state_name or state.value.lower()}{seconds}{message}".splitlines()[0])
        seen[run.id] = state
    return lines


def served_runs(flow_names: list[str]) -> list[FlowRun]:
    """The latest runs of the served flows that a deployment started (subflows are part of their parent)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import (
        FlowFilter,
        FlowFilterName,
        FlowRunFilter,
        FlowRunFilterDeploymentId,
    )
    from prefect.client.schemas.sorting import FlowRunSort

    with get_client(sync_client=True) as client:
        return client.read_flow_runs(
            flow_filter=FlowFilter(name=FlowFilterName(any_=flow_names)),
            flow_run_filter=FlowRunFilter(deployment_id=FlowRunFilterDeploymentId(is_null_=False)),
            sort=FlowRunSort.EXPECTED_START_TIME_DESC, limit=100,
        )


class RunFeed(threading.Thread):
    """Prints run_lines for the served flows every POLL_SECONDS until stopped (a daemon: never holds serve open)."""

    def __init__(self, flow_names: list[str], out: TextIO = sys.stderr, poll_seconds: float = POLL_SECONDS) -> None:
        super().__init__(name="mergeflow-run-feed", daemon=True)
        self.flow_names, self.out, self.poll_seconds = flow_names, out, poll_seconds
        self.stop = threading.Event()
        self.ready = threading.Event()  # set once the runs that existed before serve started are known
        self.seen: dict[UUID, StateType | None] = {}
        # Prefect's settings (the API URL) live in context variables, which a new thread does not inherit.
        self.context = contextvars.copy_context()

    def run(self) -> None:
        self.context.run(self._poll)

    def _poll(self) -> None:
        baseline = True  # runs that ended before serve started are history, not news
        while not self.stop.is_set():
            try:
                runs = served_runs(self.flow_names)
            except Exception:  # noqa: BLE001 - the server may be restarting: the feed is a courtesy, serving goes on
                runs = None
            if runs is not None:
                if baseline:
                    self.seen.update({r.id: r.state_type for r in runs})
                    baseline = False
                    self.ready.set()
                for line in run_lines(self.seen, runs):
                    print(line, file=self.out, flush=True)
            self.stop.wait(self.poll_seconds)
