"""Validation tasks: the checks `test` runs on any artifact, the unchanged-weights guard, and the checks of a staged export.

Thin wrappers: the checks live in the domain (mergeflow.export.check.artifact_check, mergeflow.export.check.staged_check)
so that `mergeflow test` runs them without Prefect. `validate_staged` is looked up in this module at
call time, so a test can wrap it (tests/test_resume.py corrupts a shard just before it).
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from mergeflow.export.check.artifact_check import ArtifactCounts, validate_artifact_dir
from mergeflow.export.check.staged_check import validate_staged
from mergeflow.export.check.unchanged import guard_unchanged
from mergeflow.formats.manifest import Manifest, UnchangedMeasurement
from mergeflow.records import MergePlan, ShardRecord, ValidationReport, VerifiedFile


@task(name="guard-unchanged", task_run_name="guard-unchanged", cache_policy=NO_CACHE)
def guard_unchanged_task(plan: MergePlan, shards: list[ShardRecord], allow_unchanged: bool,
                         trained: frozenset[str] = frozenset()) -> UnchangedMeasurement | None:
    """Refuse an export whose tensors equal the base's bit for bit (unless allowed): a sample first, then all."""
    return guard_unchanged(plan, shards, allow_unchanged, trained)


@task(name="validate-staged", task_run_name="validate-staged", cache_policy=NO_CACHE)
def validate_staged_task(plan: MergePlan, manifest: Manifest,
                         verified: dict[str, VerifiedFile] | None = None) -> ValidationReport:
    """Re-check the staged artifact end to end before it may be published."""
    return validate_staged(plan, manifest, verified)


@task(name="verify-signature", task_run_name="verify-signature", cache_policy=NO_CACHE)
def verify_signature_task(path: str, verify_key: str) -> str:
    """Verify the artifact's OpenSSF model signature with the public key: "verified by <fingerprint>"."""
    from mergeflow.signing import verify_artifact

    return verify_artifact(Path(path), verify_key)


@task(name="validate-artifact", task_run_name="validate-artifact")  # the flow run names the artifact: no machine path here
def validate_artifact_task(path: str) -> ArtifactCounts:
    """Validate a published (or staged) artifact without its source checkpoint."""
    summary = validate_artifact_dir(Path(path))
    return {"architecture": summary.architecture, "artifact_type": summary.artifact_type,
            "files": summary.files, "tensors": summary.tensors}
