"""Backfill past one machine: one flow run per checkpoint, through the merge deployment on a work pool.

Distribution is at checkpoint granularity: each step becomes one run of the event-triggered merge
deployment (`mergeflow-merge-checkpoint/on-checkpoint`), whichever worker of its pool picks it
up; the task runner (threads, or a Dask cluster) only parallelises inside one export. All steps
are dispatched at once; the pool's and the deployment's concurrency limits decide how many run
together. The runs are linked to the backfill run as its subflows (the UI shows them under it).

A step's run is given its checkpoint as the event payload would name it (local_dir, step,
run_name, base_model, target_dir) and the backfill's export settings; the deployment's own
confinement (checkpoint_roots, target_root, allowed_base_models) still applies to it. A run that
does not complete (Failed, or Crashed: its worker died with it) leaves its staging; the next
backfill dispatches the step again and that run resumes the staging.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import UUID

from mergeflow.config import ModelMergerConfig
from mergeflow.errors import MergeflowError, UsageError
from mergeflow.formats.verl_checkpoint import step_of
from mergeflow.ops.backfill import StepResult

MERGE_DEPLOYMENT = "mergeflow-merge-checkpoint/on-checkpoint"


class FanOutError(MergeflowError):
    """Some of a fanned-out backfill's step runs did not complete; a rerun of the backfill resumes them."""

    resumable = True


@dataclass
class FanOut:
    """The backfill's `merge`: dispatches one run of `deployment` per step (returns at once), then `wait()`."""

    deployment: str
    run_name: str
    settings: Mapping[str, Any]  # the export parameters every step's run gets (output_format, workers, ...)
    runs: dict[str, UUID] = field(default_factory=dict)  # target_dir -> flow run id

    def __call__(self, config: ModelMergerConfig) -> object:
        from prefect.deployments import run_deployment

        actor_dir = Path(config.local_dir)
        checkpoint = {"local_dir": str(actor_dir), "step": step_of(actor_dir.parent.name), "run_name": self.run_name,
                      "base_model": config.base_model, "target_dir": config.target_dir}
        # timeout=0: dispatch only; as a subflow, so the backfill run's page lists every step's run.
        run = run_deployment(name=self.deployment, parameters={"checkpoint": checkpoint, **self.settings},
                             timeout=0, as_subflow=True)
        self.runs[str(config.target_dir)] = run.id
        return run.id

    def wait(self, poll_seconds: float = 0.5) -> dict[str, Any]:
        """target_dir -> final state of its run, once every dispatched run has ended."""
        from prefect.client.orchestration import get_client

        final: dict[str, Any] = {}
        with get_client(sync_client=True) as client:
            while len(final) < len(self.runs):
                for target, run_id in self.runs.items():
                    if target not in final:
                        state = client.read_flow_run(run_id).state
                        if state is not None and state.is_final():
                            final[target] = state
                if len(final) < len(self.runs):
                    time.sleep(poll_seconds)
        return final


def require_deployment(name: str) -> None:
    """Refuse, before anything is dispatched, a deployment the server does not have, or a name that is not
    FLOW/DEPLOYMENT: otherwise every step would become a failed run, one per step."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound
    from prefect.settings import PREFECT_API_URL

    with get_client(sync_client=True) as client:
        try:
            client.read_deployment_by_name(name)
        except ObjectNotFound:
            raise UsageError(f"the Prefect server at {PREFECT_API_URL.value() or 'this process'} has no deployment "
                             f"{name!r}; deploy it (prefect deploy --all --prefect-file deployments/prefect.yaml, or "
                             f"mergeflow serve), or backfill without --deployment") from None
        except ValueError:  # not FLOW/DEPLOYMENT
            raise UsageError(f"deployment {name!r} is not named FLOW/DEPLOYMENT (e.g. {MERGE_DEPLOYMENT})") from None


def settle(results: list[StepResult], final: Mapping[str, Any]) -> list[StepResult]:
    """The backfill's lines with each dispatched step's outcome: done when its run Completed, else failed."""
    settled = []
    for result in results:
        state = final.get(result.target)
        if state is None or result.status != "done" or state.is_completed():
            settled.append(result)
        else:
            message = f"{state.name}: {state.message}" if state.message else state.name
            settled.append(StepResult(result.step, "failed", result.target, message))
    return settled
