"""The runtime check as a task: one denoising step of the staged (or a published) artifact.

Retried on what the error hierarchy calls transient (a flaky disk); a failed check is a result, not retried.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from mergeflow.export.publish import record_runtime
from mergeflow.lora.artifact import ADAPTER_DIR
from mergeflow.ops.smoke import run_runtime_check
from mergeflow.records import Manifest, MergePlan, SmokeSettings
from mergeflow.tasks import RETRY_IO


@task(name="runtime-check", task_run_name="runtime-check", **RETRY_IO, cache_policy=NO_CACHE)
def runtime_check_task(path: str, device: str, dtype: str, base: str | None = None,
                       trust_remote_code: bool = False) -> dict[str, Any]:
    """Load the artifact at `path` with Diffusers and run one step; its record (it never writes the artifact)."""
    return run_runtime_check(Path(path), device=device, dtype=dtype, base=Path(base) if base else None,
                             trust_remote_code=trust_remote_code)


@task(name="runtime-check-staged", task_run_name="runtime-check-staged", **RETRY_IO, cache_policy=NO_CACHE)
def runtime_check_staged_task(plan: MergePlan, manifest: Manifest, settings: SmokeSettings, adapter_file: str | None = None) -> Manifest:
    """--smoke: the check on the staged artifact (`adapter_file`: a LoRA-only export's lora_adapter/), then
    its record into the staged card and manifest, before validation and publication."""
    root = Path(plan.output.artifact_dir) / ADAPTER_DIR if adapter_file else Path(plan.output.artifact_dir)
    base = plan.base.base_dir or None
    record = run_runtime_check(root, device=settings.device, dtype=settings.dtype, base=Path(base) if base else None,
                               trust_remote_code=settings.trust_remote_code)
    get_run_logger().info("Runtime check passed: %s, %s on %s in %s s, output %s", record["loaded_as"], record["step"],
                          record["device"], record["seconds"], record["output"]["shape"])
    return record_runtime(plan, manifest, root, adapter_file or plan.output.weights_name, record)
