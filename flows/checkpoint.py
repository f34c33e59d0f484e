"""The merge a `mergeflow.checkpoint.saved` event starts: event payload + served defaults -> merge.

The served deployment's trigger passes the whole event payload as one parameter
(`checkpoint`). Prefect renders a trigger parameter such as `{{ event.payload.base_model }}`
through `tojson`, and a key the event lacks then fails the whole action (no flow run at all),
so optional keys are resolved here, in Python, against the defaults given to `serve`.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

from prefect.runtime import flow_run
from pydantic import BaseModel, ConfigDict, Field

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
    PublishedMerge,
    Quantize,
    SmokeDevice,
    TaskRunner,
)
from mergeflow.errors import UsageError
from mergeflow.flows.heartbeats import skip_heartbeat_join
from mergeflow.flows.merge import merge_flow
from mergeflow.flows.prefect_flow import flow
from mergeflow.flows.run_names import export_label, slug
from mergeflow.flows.runners import make_task_runner
from mergeflow.formats.verl_checkpoint import step_of
from mergeflow.io.confinement import Confinement
from mergeflow.io.jsonfiles import JsonObject
from mergeflow.ops.serve_settings import format_with_checkpoint
from mergeflow.ops.step_targets import default_target, plain_name

skip_heartbeat_join()  # a flow run ends without waiting for its heartbeat thread (flows/heartbeats.py)

FORMAT_FIELDS = ("run_name", "step")


def _step_of(checkpoint: JsonObject, actor_dir: Path) -> int | None:
    step = checkpoint.get("step")
    if step is None:
        return step_of(actor_dir.parent.name)
    if isinstance(step, str) and step.isdigit():
        return int(step)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise UsageError(f"the event's step must be a non-negative integer, not {step!r}")
    return step


def _absolute(value: Any, what: str) -> str:
    if not isinstance(value, str) or not Path(value).is_absolute():
        raise UsageError(f"the event's {what} must be an absolute path (the deployment runs elsewhere), not {value!r}")
    return value


def resolve_checkpoint_config(
    checkpoint: JsonObject,
    *,
    confinement: Confinement,
    base_model: str | None = None,
    target_root: str | None = None,
    output_format: OutputFormat = DEFAULT_OUTPUT_FORMAT,
    dtype: Dtype = DEFAULT_DTYPE,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    hf_upload_path: str | None = None,
    private: bool = False,
    workers: int = DEFAULT_WORKERS,
    quantize: Quantize = DEFAULT_QUANTIZE,
    extract_lora: int | None = None,
    extract_energy: float | None = None,
    sign_key: str | None = None,
    smoke: bool = False,
    smoke_device: SmokeDevice = "cpu",
    base_model_id: str | None = None,
) -> ModelMergerConfig:
    """The merge config for one event payload; payload keys override the served defaults.

    Every path the payload names is checked against `confinement` (resolved, symlinks
    followed) before anything is read or written; the config holds the resolved paths.
    """
    if not isinstance(checkpoint, dict) or checkpoint.get("local_dir") is None:
        raise UsageError("the checkpoint event has no local_dir; emit it with mergeflow.events.checkpoint_saved(path)")
    # Names (run, step) come from the path as the event gave it; reading uses the resolved one.
    actor_dir = Path(_absolute(checkpoint["local_dir"], "local_dir"))
    step = _step_of(checkpoint, actor_dir)
    given = checkpoint.get("run_name")  # only a missing (null) one defaults: "" is refused like any unsafe name
    run_name = plain_name(given if given is not None else actor_dir.parent.parent.name or "checkpoints", "run_name")
    local_dir = confinement.checkpoint(str(actor_dir))
    base = checkpoint.get("base_model") or base_model
    if not base:
        raise UsageError("no base model: serve with --base_model or put base_model in the event payload")
    base = confinement.base_model(_absolute(str(base), "base_model"))
    if checkpoint.get("target_dir"):
        target = Path(_absolute(checkpoint["target_dir"], "target_dir"))
    elif target_root:
        target = default_target(target_root, run_name, step, actor_dir)
    else:
        raise UsageError("no target: serve with --target-root or put target_dir in the event payload")
    config = ModelMergerConfig(
        operation="merge",
        local_dir=local_dir,
        base_model=base,
        target_dir=confinement.target(target),
        output_format=output_format,
        dtype=dtype,
        quantize=quantize,
        max_shard_size=max_shard_size,
        hf_upload_path=format_with_checkpoint(hf_upload_path, run_name, step, "--hf_upload_path"),
        private=private,
        workers=workers,
        extract_lora=extract_lora,
        extract_energy=extract_energy,
        sign_key=sign_key,  # the deployment's, never the event's: who signs is the operator's choice
        smoke=smoke,
        smoke_device=smoke_device,
        base_model_id=checkpoint.get("base_model_id") or base_model_id,
    )
    config.validate()
    return config


class CheckpointPayload(BaseModel):
    """The `mergeflow.checkpoint.saved` event's payload: the checkpoint to export (what the UI's form asks for)."""

    # Training code may add its own keys (`extra=` of checkpoint_saved); they ride along unread.
    model_config = ConfigDict(extra="allow")

    # Typed loosely on purpose: Prefect validates parameters when it creates the run, and a wrongly typed
    # value there meant no flow run at all; resolve_checkpoint_config checks them inside the run instead.
    local_dir: Any = Field(description="Absolute path of the checkpoint's actor directory, as verl saves it: "
                                       "<train_dir>/global_step_<N>/actor (below one of checkpoint_roots).")
    step: Any = Field(default=None, description="Training step N; default: read from the global_step_<N> folder name.")
    run_name: Any = Field(default=None, description="Training run name (a plain folder name); default: the folder "
                                                           "above global_step_<N>. Names the target and the flow run.")
    base_model: Any = Field(default=None, description="Absolute path of the base model; default: the deployment's "
                                                             "base_model (or one of allowed_base_models).")
    target_dir: Any = Field(default=None, description="Absolute path to publish to (below target_root); default: "
                                                             "<target_root>/<run_name>/global_step_<N>.")


def payload_dict(checkpoint: CheckpointPayload | JsonObject) -> JsonObject:
    """The payload as the plain JSON object the event carried (the flow may be called with either)."""
    return checkpoint.model_dump() if isinstance(checkpoint, BaseModel) else checkpoint


def checkpoint_run_name() -> str:
    """`checkpoint-<run>-step<N>`: the event's run name, the one its merge subflow (`merge-<run>-step<N>`) carries unless `watch --run-name` renamed the run."""
    checkpoint = (flow_run.parameters or {}).get("checkpoint") or {}
    payload = payload_dict(checkpoint) if isinstance(checkpoint, (dict, BaseModel)) else {}
    run, step = payload.get("run_name"), payload.get("step")
    if run and isinstance(step, int) and not isinstance(step, bool):
        return f"checkpoint-{slug(str(run)) or 'run'}-step{step}"
    return f"checkpoint-{export_label(payload.get('target_dir') or payload.get('local_dir'), payload.get('local_dir'))}"


@flow(name="mergeflow-merge-checkpoint", flow_run_name=checkpoint_run_name, validate_parameters=True)
def merge_checkpoint_flow(
    checkpoint: CheckpointPayload,
    base_model: str | None = None,
    target_root: str | None = None,
    output_format: OutputFormat = DEFAULT_OUTPUT_FORMAT,
    dtype: Dtype = DEFAULT_DTYPE,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    hf_upload_path: str | None = None,
    private: bool = False,
    workers: int = DEFAULT_WORKERS,
    task_runner: TaskRunner = DEFAULT_TASK_RUNNER,
    dask_address: str | None = None,
    checkpoint_roots: list[str] | None = None,
    allowed_base_models: list[str] | None = None,
    quantize: Quantize = DEFAULT_QUANTIZE,
    extract_lora: int | None = None,
    extract_energy: float | None = None,
    sign_key: str | None = None,
    smoke: bool = False,
    smoke_device: SmokeDevice = "cpu",
    base_model_id: str | None = None,
) -> PublishedMerge:
    """Export the checkpoint an event names (payload keys override these defaults).

    The event may only name checkpoints under `checkpoint_roots`, targets under `target_root`
    and the base models `base_model` and `allowed_base_models`: anything else is refused
    before it is read or written.

    Args:
        checkpoint: The checkpoint to export: the event's payload (a trigger passes it whole).
        base_model: Absolute path of the base model a payload without base_model merges onto.
        target_root: Exports go to <target_root>/<run_name>/global_step_<N>; every target must lie below it.
        output_format: pipeline: the whole Diffusers pipeline; transformer: the trained transformer alone.
        dtype: Dtype of the written weights; preserve keeps the trained dtypes.
        max_shard_size: Bytes per output .safetensors file (2147483648 = 2 GiB).
        hf_upload_path: ORG/REPO to upload each export to after publication; may use {run_name} and {step}.
        private: Create the Hub repo private.
        workers: Parallel rank loaders and shard writers.
        task_runner: thread: in this process; dask: on the Dask cluster at dask_address (shared filesystem).
        dask_address: Scheduler address of a running Dask cluster (default: a temporary local cluster).
        checkpoint_roots: An event's local_dir must lie below one of these (symlinks followed).
        allowed_base_models: Base models an event may name besides base_model.
        quantize: Weight encoding: fp8 with output_format single_file (ComfyUI's scaled float8); none keeps dtype.
        extract_lora: Publish a LoRA of (trained - base) at this rank instead of the model (None: off).
        extract_energy: With extract_lora: per layer the smallest rank keeping this fraction of ||dW||, capped at it.
        sign_key: Absolute path of an elliptic-curve private key (PEM) on the worker: each export is signed
            (OpenSSF model signing, model.sig) before it is published. Default: the worker's MERGEFLOW_SIGN_KEY.
        smoke: Run the runtime check (load with Diffusers, one denoising step) before publishing; a failure publishes nothing.
        smoke_device: cpu, or cuda where the worker has one.
        base_model_id: The base's Hub id for the model card (org/name) when base_model is a local folder.
    """
    payload = payload_dict(checkpoint)
    confinement = Confinement.of(checkpoint_roots, target_root, [b for b in (base_model, *(allowed_base_models or ())) if b])
    config = resolve_checkpoint_config(
        payload, confinement=confinement, base_model=base_model, target_root=target_root, output_format=output_format, dtype=dtype,
        max_shard_size=max_shard_size, hf_upload_path=hf_upload_path, private=private, workers=workers, quantize=quantize,
        extract_lora=extract_lora, extract_energy=extract_energy, sign_key=sign_key, smoke=smoke,
        smoke_device=smoke_device, base_model_id=base_model_id,
    )
    target = Path(str(config.target_dir))
    if not Path(confinement.target_root).is_dir():
        raise UsageError(f"--target-root {target_root} does not exist (any more); create it")
    made = not payload.get("target_dir") and not target.parent.exists()
    if made:
        target.parent.mkdir()  # the per-run folder under the target root (checked above)
    try:
        runner = make_task_runner(task_runner, workers=workers, dask_address=dask_address)
        return merge_flow.with_options(task_runner=runner)(config=config)
    except BaseException:
        if made:  # a refused or failed export leaves no empty exports/<run>/ behind
            with contextlib.suppress(OSError):
                target.parent.rmdir()  # only if still empty: kept staging stays, with its folder
        raise
