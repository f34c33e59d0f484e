"""`mergeflow serve`: the merge, validate and backfill deployments, the merge one triggered by checkpoint events.

- `mergeflow-merge-checkpoint/on-checkpoint`: one run per `mergeflow.checkpoint.saved` event.
- `mergeflow-validate/validate`: re-check a published artifact (or a failed merge's kept staging).
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

from dataclasses import asdict, dataclass
from pathlib import Path

from prefect.deployments.runner import EntrypointType, RunnerDeployment
from prefect.events import DeploymentEventTrigger

from mergeflow.config import (
    DEFAULT_DTYPE,
    DEFAULT_MAX_SHARD_SIZE,
    DEFAULT_OUTPUT_FORMAT,
    DEFAULT_TASK_RUNNER,
    DEFAULT_WORKERS,
    DTYPES,
    MAX_WORKERS,
    OUTPUT_FORMATS,
    TASK_RUNNERS,
    Dtype,
    OutputFormat,
    TaskRunner,
)
from mergeflow.errors import UsageError
from mergeflow.events import EVENT_CHECKPOINT_SAVED, RESOURCE_PREFIX
from mergeflow.flows.backfill_flow import backfill_flow
from mergeflow.flows.checkpoint import format_with_checkpoint, merge_checkpoint_flow
from mergeflow.flows.events import reachable_api_url
from mergeflow.flows.run_feed import RunFeed
from mergeflow.flows.validate import validate_flow
from mergeflow.io.jsonfiles import JsonObject

MERGE_DEPLOYMENT = "on-checkpoint"
VALIDATE_DEPLOYMENT = "validate"
BACKFILL_DEPLOYMENT = "backfill"
TRIGGER_NAME = "mergeflow-checkpoint-saved"
# One parameter carries the whole payload: `{{ event.payload.<key> }}` for an optional key the
# event lacks makes Prefect fail the trigger's action, so defaults are resolved in the flow.
TRIGGER_PARAMETERS = {"checkpoint": "{{ event.payload }}"}


@dataclass(frozen=True)
class ServeSettings:
    """Defaults of every triggered merge (an event's payload may override base_model and target)."""

    base_model: str
    target_root: str
    output_format: OutputFormat = DEFAULT_OUTPUT_FORMAT
    dtype: Dtype = DEFAULT_DTYPE
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE
    hf_upload_path: str | None = None
    private: bool = False
    workers: int = DEFAULT_WORKERS
    task_runner: TaskRunner = DEFAULT_TASK_RUNNER
    dask_address: str | None = None
    # Where events may point: checkpoints below these roots, and these base models besides base_model.
    checkpoint_roots: tuple[str, ...] = ()
    allowed_base_models: tuple[str, ...] = ()

    def checked(self) -> ServeSettings:
        """Absolute paths, known choices; refuse what every triggered run would fail on."""
        base = Path(self.base_model).expanduser().resolve()
        root = Path(self.target_root).expanduser().resolve()
        if not base.is_dir():
            raise UsageError(f"--base_model {self.base_model} is not a local directory")
        if not root.is_dir():
            raise UsageError(f"--target-root {self.target_root} does not exist; create it first")
        if not self.checkpoint_roots:
            raise UsageError("--checkpoint-root is required: events may only name checkpoints below it (repeat it for several)")
        checkpoint_roots = tuple(_existing_dir(p, "--checkpoint-root") for p in self.checkpoint_roots)
        allowed = tuple(_existing_dir(p, "--allow-base-model") for p in self.allowed_base_models)
        if self.output_format not in OUTPUT_FORMATS:
            raise UsageError(f"--output_format must be one of {', '.join(OUTPUT_FORMATS)}")
        if self.dtype not in DTYPES:
            raise UsageError(f"--dtype must be one of {', '.join(DTYPES)}")
        if self.task_runner not in TASK_RUNNERS:
            raise UsageError(f"--task-runner must be one of {', '.join(TASK_RUNNERS)}")
        if not 1 <= self.workers <= MAX_WORKERS:
            raise UsageError(f"--workers must be between 1 and {MAX_WORKERS}")
        format_with_checkpoint(self.hf_upload_path, "run", 0, "--hf_upload_path")
        return ServeSettings(**{**asdict(self), "base_model": str(base), "target_root": str(root),
                                "checkpoint_roots": checkpoint_roots, "allowed_base_models": allowed})

    def parameters(self) -> JsonObject:
        """The merge deployment's default parameters (the trigger adds `checkpoint`)."""
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}

    def backfill_parameters(self) -> JsonObject:
        """The backfill deployment's defaults: the merge's, less what only an event's merge uses.

        A run supplies train_dir. No upload settings: `mergeflow backfill` publishes locally only.
        """
        merge = self.parameters()
        keep = ("base_model", "target_root", "output_format", "dtype", "max_shard_size", "workers", "task_runner",
                "dask_address", "checkpoint_roots")
        return {k: merge[k] for k in keep}


def _existing_dir(path: str, flag: str) -> str:
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_dir():
        raise UsageError(f"{flag} {path} is not a directory")
    return str(resolved)


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
    return [merge, validate, backfill]


def served_names() -> list[str]:
    """`<flow>/<deployment>` of every deployment `serve` registers (what `prefect deployment run` takes)."""
    return [f"{merge_checkpoint_flow.name}/{MERGE_DEPLOYMENT}", f"{validate_flow.name}/{VALIDATE_DEPLOYMENT}",
            f"{backfill_flow.name}/{BACKFILL_DEPLOYMENT}"]


def serve_deployments(settings: ServeSettings, *, limit: int | None = 1) -> None:
    """Register the deployments and run their flow runs here until interrupted (blocks)."""
    from prefect import serve

    settings = settings.checked()
    # Without an API URL, serve would start a private temporary server no training job can reach.
    reachable_api_url()
    feed = RunFeed([merge_checkpoint_flow.name, validate_flow.name, backfill_flow.name])  # one line per run started and finished
    feed.start()
    try:
        serve(*build_deployments(settings), limit=limit)
    finally:
        feed.stop.set()
