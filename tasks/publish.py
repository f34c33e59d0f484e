"""The last two tasks of an export: metadata and manifest into staging, then the atomic publish."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from mergeflow.export.publish import finalize_staging, publish_staged
from mergeflow.formats.manifest import LoraFusion, Manifest, UnchangedMeasurement
from mergeflow.records import (
    FileRecord,
    MergePlan,
    OutputPlan,
    ShardRecord,
    ValidationReport,
)
from mergeflow.tasks import RETRY_IO


@task(name="write-metadata", task_run_name="write-metadata", **RETRY_IO, cache_policy=NO_CACHE)
def write_metadata(plan: MergePlan, output: OutputPlan, rank_digests: dict[str, str], shards: list[ShardRecord],
                   extra_files: list[FileRecord] | None = None, lora_fusion: LoraFusion | None = None,
                   unchanged: UnchangedMeasurement | None = None) -> Manifest:
    """Write config, weight index and manifest into staging."""
    return finalize_staging(plan, output, rank_digests, shards, extra_files, lora_fusion, unchanged)


@task(name="publish", task_run_name="publish", cache_policy=NO_CACHE)
def publish(plan: MergePlan, report: ValidationReport) -> dict[str, str]:
    """Atomically publish the validated staging directory as the target."""
    return publish_staged(plan, report)
