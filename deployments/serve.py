"""`mergeflow serve`: the merge, validate and backfill deployments, the merge one triggered by checkpoint events.

- `mergeflow-merge-checkpoint/on-checkpoint`: one run per `mergeflow.checkpoint.saved` event.
- `mergeflow-validate/validate`: re-check a published artifact (or a failed merge's kept staging).
- `mergeflow-smoke/smoke`: the runtime check (one denoising step) of a published artifact, rerun alone.
- `mergeflow-backfill/backfill`: no trigger, run on demand (`prefect deployment run
  mergeflow-backfill/backfill --param train_dir=/checkpoints/run-a`, or the UI's form): exports
  every complete, unpublished global_step_N of a training run with serve's settings, to the
  targets the triggered merges use, so it catches up on steps saved while nothing was serving.

`serve_deployments(settings)` registers the three deployments with the Prefect server named by
PREFECT_API_URL and runs them in this process (Prefect's runner starts one subprocess per
flow run). The same deployments are declared in `deployments/prefect.yaml` for
`prefect deploy --all` onto a process work pool.
"""

from __future__ import annotations

import asyncio
import shutil

from prefect.deployments.runner import EntrypointType, RunnerDeployment
from prefect.events import DeploymentEventTrigger

from mergeflow.deployments.run_feed import RunFeed
from mergeflow.events import EVENT_CHECKPOINT_SAVED, RESOURCE_PREFIX
from mergeflow.flows.backfill_flow import backfill_flow
from mergeflow.flows.checkpoint import merge_checkpoint_flow
from mergeflow.flows.events import reachable_api_url
from mergeflow.flows.smoke import smoke_flow
from mergeflow.flows.validate import validate_flow
from mergeflow.ops.serve_settings import ServeSettings

MERGE_DEPLOYMENT = "on-checkpoint"
VALIDATE_DEPLOYMENT = "validate"
SMOKE_DEPLOYMENT = "smoke"
BACKFILL_DEPLOYMENT = "backfill"
TRIGGER_NAME = "mergeflow-checkpoint-saved"
# One parameter carries the whole payload: `{{ event.payload.<key> }}` for an optional key the
# event lacks makes Prefect fail the trigger's action, so defaults are resolved in the flow.
TRIGGER_PARAMETERS = {"checkpoint": "{{ event.payload }}"}


def checkpoint_trigger() -> DeploymentEventTrigger:
    """Run the merge deployment once per `mergeflow.checkpoint.saved` event."""
    return DeploymentEventTrigger(
        name=TRIGGER_NAME,
        expect={EVENT_CHECKPOINT_SAVED},
        match={"prefect.resource.id": f"{RESOURCE_PREFIX}*"},
        parameters=dict(TRIGGER_PARAMETERS),
    )


def build_deployments(settings: ServeSettings) -> list[RunnerDeployment]:
    """The merge deployment (with its event trigger), the validate and the backfill deployments (run on demand)."""
    merge = merge_checkpoint_flow.to_deployment(
        name=MERGE_DEPLOYMENT,
        parameters=settings.parameters(),
        triggers=[checkpoint_trigger()],
        description="Export a checkpoint named by a mergeflow.checkpoint.saved event (or by the `checkpoint` parameter).",
        tags=["mergeflow"],
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    validate = validate_flow.to_deployment(
        name=VALIDATE_DEPLOYMENT,
        parameters={"within": settings.target_root},  # the exports (and their kept staging) only
        description="Validate a published artifact, or the kept staging directory of a failed merge.",
        tags=["mergeflow"],
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    backfill = backfill_flow.to_deployment(
        name=BACKFILL_DEPLOYMENT,
        parameters=settings.backfill_parameters(),
        description="Export every complete, unpublished global_step_N of a training run (train_dir), oldest first; "
                    "run on demand.",
        tags=["mergeflow"],
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    smoke = smoke_flow.to_deployment(
        name=SMOKE_DEPLOYMENT,
        parameters={"within": settings.target_root, "served_base": settings.base_model},
        description="Runtime check: load a published artifact with Diffusers and run one denoising step; "
                    "reports, never rewrites the artifact.",
        tags=["mergeflow"],
        entrypoint_type=EntrypointType.MODULE_PATH,
    )
    return [merge, validate, backfill, smoke]


def served_names() -> list[str]:
    """`<flow>/<deployment>` of every deployment `serve` registers (what `prefect deployment run` takes)."""
    return [f"{merge_checkpoint_flow.name}/{MERGE_DEPLOYMENT}", f"{validate_flow.name}/{VALIDATE_DEPLOYMENT}",
            f"{backfill_flow.name}/{BACKFILL_DEPLOYMENT}", f"{smoke_flow.name}/{SMOKE_DEPLOYMENT}"]


def serve_deployments(settings: ServeSettings, *, limit: int | None = 1) -> None:
    """Register the deployments and run their flow runs here until interrupted (blocks)."""
    settings = settings.checked()
    # Without an API URL, serve would start a private temporary server no training job can reach.
    reachable_api_url()
    feed = RunFeed([merge_checkpoint_flow.name, validate_flow.name, backfill_flow.name, smoke_flow.name])  # one line per run started and finished
    feed.start()
    try:
        _serve(build_deployments(settings), limit=limit)
    finally:
        feed.stop.set()


def _serve(deployments: list[RunnerDeployment], *, limit: int | None) -> None:
    """`prefect.serve(*deployments, limit=limit)`, but the runner's scratch directory always goes.

    Prefect's Runner makes `$TMPDIR/runner_storage/<uuid>` when it starts and removes it only when its
    services all stop without an error; a Ctrl-C ends them with one, so each served process left an
    empty directory behind. mergeflow's deployments pull no code into it (module entrypoints).
    """
    from prefect.exceptions import TerminationSignal
    from prefect.flows import _display_serve_start_message
    from prefect.logging import get_logger
    from prefect.runner import Runner

    runner = Runner(pause_on_shutdown=True, limit=limit)
    for deployment in deployments:
        runner.add_deployment(deployment)
    _display_serve_start_message(*deployments)
    try:
        asyncio.run(runner.start())
    except (KeyboardInterrupt, TerminationSignal) as exc:  # Ctrl-C, SIGTERM: the runner has stopped its runs
        get_logger("mergeflow.serve").info(f"Received {type(exc).__name__}, shutting down...")  # as prefect.serve logs
    finally:
        scratch = getattr(runner, "_tmp_dir", None)  # private: nothing public names it
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
