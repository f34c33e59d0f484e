"""The Python API: merge_model(config) and validate_artifact(path), each running its flow."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect.task_runners import ThreadPoolTaskRunner

from mergeflow.config import MergeResult, ModelMergerConfig
from mergeflow.flows.merge import merge_flow
from mergeflow.flows.validate import validate_flow


def merge_model(config: ModelMergerConfig) -> MergeResult:
    """Run the merge flow for `config` and return where the artifact was published."""
    config.validate()
    runner = ThreadPoolTaskRunner(max_workers=config.workers)
    result = merge_flow.with_options(task_runner=runner)(config=config)
    return MergeResult(output_dir=result["output_dir"], manifest_path=result["manifest_path"], upload=result.get("upload"))


def validate_artifact(path: str | Path) -> dict[str, Any]:
    """Run the validate flow on a published (or staged) artifact; raises ValidationError on any defect."""
    return validate_flow(test_hf_dir=str(path))
