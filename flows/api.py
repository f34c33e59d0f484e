"""The Python API: merge_model(config) and validate_artifact(path), each running its flow."""

from __future__ import annotations

from pathlib import Path

from mergeflow.config import DEFAULT_TASK_RUNNER, MergeResult, ModelMergerConfig
from mergeflow.export.check.artifact_check import IntegrityResult
from mergeflow.export.plan.preflight import preflight_merge
from mergeflow.flows.merge import merge_flow
from mergeflow.flows.runners import make_task_runner
from mergeflow.flows.validate import validate_flow
from mergeflow.io.session import export_session


def merge_model(config: ModelMergerConfig, *, task_runner: str = DEFAULT_TASK_RUNNER, dask_address: str | None = None) -> MergeResult:
    """Run the merge flow for `config` (threads, or Dask with task_runner="dask") and return where it was published."""
    with export_session():  # the caller's (the command line's), else this export's own
        # Planning's first stage (flags, paths, the base's layout), once per export: the command line has
        # usually run it already, before importing Prefect; the flow's inspect task takes it from the session.
        # Bad options are refused before a task runner (a Dask cluster) starts.
        preflight_merge(config)
        runner = make_task_runner(task_runner, workers=config.workers, dask_address=dask_address)
        result = merge_flow.with_options(task_runner=runner)(config=config)
    return MergeResult(output_dir=result["output_dir"], manifest_path=result["manifest_path"], upload=result.get("upload"))


def validate_artifact(path: str | Path, verify_key: str | Path | None = None) -> IntegrityResult:
    """Run the validate flow on a published (or staged) artifact; raises ArtifactInvalidError on any defect.

    `verify_key`: an elliptic-curve public key (PEM): the artifact's OpenSSF model signature must verify with it.
    """
    return validate_flow(test_hf_dir=str(path), verify_key=str(verify_key) if verify_key is not None else None)
