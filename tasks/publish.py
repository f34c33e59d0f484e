"""The last tasks of an export: metadata and manifest into staging, the seal (pin, signature), the atomic publish."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE
from prefect.runtime import task_run

from mergeflow.export.publish import finalize_staging, publish_staged, seal_staged
from mergeflow.formats.manifest import LoraFusion, Manifest, UnchangedMeasurement
from mergeflow.records import (
    FileRecord,
    MergePlan,
    OutputPlan,
    SealRecord,
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


def _seal_run_name() -> str:
    """`sign-artifact` when a key signs it, else `pin-manifest`: what the step did, in the run's graph."""
    plan = (task_run.parameters or {}).get("plan")
    plan = plan.unwrap() if hasattr(plan, "unwrap") else plan  # the flow passes records `opaque` (flows/merge.py)
    options = getattr(getattr(plan, "options", None), "sign_key", None)
    return "sign-artifact" if options else "pin-manifest"


@task(name="seal-artifact", task_run_name=_seal_run_name, **RETRY_IO, cache_policy=NO_CACHE)
def seal(plan: MergePlan, report: ValidationReport) -> SealRecord:
    """Pin the validated manifest and, with a key, sign every staged file (mergeflow/signing.py)."""
    return seal_staged(plan, report)


@task(name="publish", task_run_name="publish", cache_policy=NO_CACHE)
def publish(plan: MergePlan, report: ValidationReport, seal: SealRecord) -> dict[str, str]:
    """Atomically publish the validated, sealed staging directory as the target."""
    return publish_staged(plan, report, seal)
