"""Validation tasks: the checks `test` runs on any artifact, and the checks of a staged export.

Thin wrappers: the checks live in the domain (mergeflow.artifact_check, mergeflow.staged_check)
so that `mergeflow test` runs them without Prefect.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

# list_tree and manifest_relpath are re-exported for the publish task; validate_staged is looked up
# here at call time, so a test can wrap it (tests/test_resume.py corrupts a shard just before it).
from mergeflow.artifact_check import list_tree, manifest_relpath, validate_artifact_dir
from mergeflow.records import MergePlan, ValidationReport, VerifiedFile
from mergeflow.staged_check import validate_staged

__all__ = ["list_tree", "manifest_relpath", "validate_artifact_task", "validate_staged", "validate_staged_task"]


@task(name="validate-staged", task_run_name="validate-staged", cache_policy=NO_CACHE)
def validate_staged_task(plan: MergePlan, manifest: dict[str, Any],
                         verified: dict[str, VerifiedFile] | None = None) -> ValidationReport:
    """Re-check the staged artifact end to end before it may be published."""
    return validate_staged(plan, manifest, verified)


@task(name="validate-artifact", task_run_name="validate-{path}")
def validate_artifact_task(path: str) -> dict[str, Any]:
    """Validate a published (or staged) artifact without its source checkpoint."""
    summary = validate_artifact_dir(Path(path))
    return {"architecture": summary.architecture, "artifact_type": summary.artifact_type,
            "files": summary.files, "tensors": summary.tensors}
