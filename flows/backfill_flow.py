"""The backfill as a Prefect flow: each step's export runs as a merge subflow (UI, deployments, the API).

`mergeflow serve` serves it as the `mergeflow-backfill/backfill` deployment, run on demand (no
trigger); its parameters default to serve's settings, so a backfilled step lands where, and is
written as, the triggered merge of the same step would be.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.runtime import flow_run

from mergeflow.config import (
    DEFAULT_DTYPE,
    DEFAULT_MAX_SHARD_SIZE,
    DEFAULT_OUTPUT_FORMAT,
    DEFAULT_QUANTIZE,
    DEFAULT_TASK_RUNNER,
    DEFAULT_WORKERS,
    Dtype,
    ModelMergerConfig,
    OutputFormat,
    Quantize,
    SmokeDevice,
    TaskRunner,
)
from mergeflow.errors import UsageError
from mergeflow.flows.fan_out import FanOut, FanOutError, require_deployment, settle
from mergeflow.flows.heartbeats import skip_heartbeat_join
from mergeflow.flows.merge import merge_flow
from mergeflow.flows.prefect_flow import flow
from mergeflow.flows.run_names import slug
from mergeflow.flows.runners import make_task_runner
from mergeflow.io.confinement import Confinement
from mergeflow.ops.backfill import BackfillSettings, BackfillSummary, backfill, summary
from mergeflow.ops.watch import find_checkpoints

skip_heartbeat_join()  # a flow run ends without waiting for its heartbeat thread (flows/heartbeats.py)


def backfill_run_name() -> str:
    """`backfill-<run>`: the run name its steps' targets carry (the train dir's name by default)."""
    params = flow_run.parameters or {}
    run = params.get("run_name") or Path(str(params.get("train_dir") or "")).name
    return f"backfill-{slug(str(run)) or 'run'}"


def _confine(confinement: Confinement, train_dir: str, target_root: str, run_name: str | None) -> None:
    """Refuse, before anything is read or written, a train dir (or a step folder linked into it) outside the
    checkpoint roots, or a run name that would leave the target root."""
    confinement.checkpoint(train_dir)
    name = run_name or Path(train_dir).expanduser().absolute().name
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name:
        raise UsageError(f"run_name {name!r} cannot name a directory under the target root; use a plain name")
    confinement.target(Path(target_root) / name)
    for candidate in find_checkpoints(Path(train_dir)):
        confinement.checkpoint(str(candidate.actor_dir))


@flow(name="mergeflow-backfill", flow_run_name=backfill_run_name, persist_result=True, validate_parameters=True)
def backfill_flow(
    train_dir: str,
    base_model: str,
    target_root: str,
    run_name: str | None = None,
    output_format: OutputFormat = DEFAULT_OUTPUT_FORMAT,
    dtype: Dtype = DEFAULT_DTYPE,
    allow_unchanged: bool = False,
    stable_seconds: float = 5.0,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    workers: int = DEFAULT_WORKERS,
    task_runner: TaskRunner = DEFAULT_TASK_RUNNER,
    dask_address: str | None = None,
    checkpoint_roots: list[str] | None = None,
    quantize: Quantize = DEFAULT_QUANTIZE,
    extract_lora: int | None = None,
    extract_energy: float | None = None,
    deployment: str | None = None,
    sign_key: str | None = None,
    smoke: bool = False,
    smoke_device: SmokeDevice = "cpu",
    base_model_id: str | None = None,
) -> BackfillSummary:
    """Export every complete, unpublished global_step_N of a training run, oldest first.

    Args:
        train_dir: Absolute path of verl's output directory (it holds global_step_<N>/actor).
        base_model: Absolute path of the local base model every step merges onto.
        target_root: Step N is published to <target_root>/<run_name>/global_step_<N>; published steps are skipped.
        run_name: Run name in the targets (a plain folder name); default: train_dir's folder name.
        output_format: pipeline: the whole Diffusers pipeline; transformer: the trained transformer alone.
        dtype: Dtype of the written weights; preserve keeps the trained dtypes.
        allow_unchanged: Publish a step even when every tensor equals the base's.
        stable_seconds: A checkpoint must stay unchanged this long to count as complete (as for the watcher).
        max_shard_size: Bytes per output .safetensors file (2147483648 = 2 GiB).
        workers: Parallel rank loaders and shard writers per step.
        task_runner: thread: in this process; dask: on the Dask cluster at dask_address (shared filesystem).
        dask_address: Scheduler address of a running Dask cluster (default: a temporary local cluster).
        checkpoint_roots: Set by `mergeflow serve`: train_dir must lie below one of these (symlinks followed).
        quantize: Weight encoding: fp8 with output_format single_file (ComfyUI's scaled float8); none keeps dtype.
        extract_lora: Publish a LoRA of (trained - base) at this rank instead of the model (None: off).
        extract_energy: With extract_lora: per layer the smallest rank keeping this fraction of ||dW||, capped at it.
        deployment: Fan out: each step as one run of this deployment (mergeflow-merge-checkpoint/on-checkpoint) on
            its work pool's workers, all dispatched at once; None: each step in turn, here, as a subflow.
        sign_key: Absolute path of an elliptic-curve private key (PEM) on the worker: each step is signed
            (OpenSSF model signing, model.sig) before it is published. Default: the worker's MERGEFLOW_SIGN_KEY.
        smoke: Run the runtime check (one denoising step) before each step's publication.
        smoke_device: cpu, or cuda where the worker has one.
        base_model_id: The base's Hub id for the model cards (org/name).
    """
    # A served run: its paths come from a form or the API, so they get the limits serve gives events.
    confinement = Confinement.of(checkpoint_roots, target_root, [base_model]) if checkpoint_roots is not None else None
    if confinement is not None:
        _confine(confinement, train_dir, target_root, run_name)
    logger = get_run_logger()
    settings = BackfillSettings(train_dir=train_dir, base_model=base_model, target_root=target_root, run_name=run_name,
                                output_format=output_format, dtype=dtype, allow_unchanged=allow_unchanged,
                                stable_seconds=stable_seconds, max_shard_size=max_shard_size, workers=workers,
                                quantize=quantize, extract_lora=extract_lora, extract_energy=extract_energy,
                                sign_key=sign_key, smoke=smoke, smoke_device=smoke_device, base_model_id=base_model_id)
    if deployment:
        return _fan_out(settings, deployment, task_runner, dask_address, logger)
    runner = make_task_runner(task_runner, workers=workers, dask_address=dask_address)

    def merge(config: ModelMergerConfig) -> object:
        if confinement is not None:  # again as each step starts: a step folder may have appeared since
            confinement.checkpoint(str(config.local_dir))
            confinement.target(str(config.target_dir))
        return merge_flow.with_options(task_runner=runner)(config=config)

    return summary(backfill(settings, merge, report=lambda r: logger.info("%s", r.line())))


def _for_other_machines(settings: BackfillSettings) -> BackfillSettings:
    """The step runs start on other machines, in other directories: a relative local base (a Hub id stays as it
    is) or signing key becomes absolute. backfill() already makes each step's checkpoint and target absolute."""
    base = Path(settings.base_model).expanduser()
    return replace(settings, base_model=str(base.absolute()) if base.exists() else settings.base_model,
                   sign_key=str(Path(settings.sign_key).expanduser().absolute()) if settings.sign_key else None)


def _fan_out(settings: BackfillSettings, deployment: str, task_runner: TaskRunner, dask_address: str | None,
             logger: Any) -> BackfillSummary:
    """Every unpublished complete step as one run of `deployment`; the summary once all of them have ended."""
    if settings.allow_unchanged:
        raise UsageError("allow_unchanged cannot fan out: the merge deployment has no such parameter; "
                         "backfill without deployment to publish unchanged steps")
    make_task_runner(task_runner, workers=settings.workers, dask_address=dask_address)  # a wrong pair fails here, once
    require_deployment(deployment)
    settings = _for_other_machines(settings)
    run_name = settings.run_name or Path(settings.train_dir).expanduser().absolute().name
    fan = FanOut(deployment, run_name, {
        "output_format": settings.output_format, "dtype": settings.dtype, "max_shard_size": settings.max_shard_size,
        "workers": settings.workers, "task_runner": task_runner, "dask_address": dask_address,
        "quantize": settings.quantize, "extract_lora": settings.extract_lora, "extract_energy": settings.extract_energy,
        "sign_key": settings.sign_key, "smoke": settings.smoke, "smoke_device": settings.smoke_device,
        "base_model_id": settings.base_model_id})
    results = settle(backfill(settings, fan), fan.wait())
    for result in results:
        logger.info("%s", result.line())
    failed = [r for r in results if r.status == "failed"]
    if failed:
        raise FanOutError(f"{len(failed)} of {len(fan.runs)} step runs did not complete ("
                          + "; ".join(f"global_step_{r.step}: {r.detail}" for r in failed)
                          + "); backfill again to resume them from their staging")
    return summary(results)
