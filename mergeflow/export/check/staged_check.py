"""Layer 4 on a staged export, before publication: inputs unchanged, loadable, and everything `test` checks."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from mergeflow.errors import InputChangedError
from mergeflow.export.check.artifact_check import (
    manifest_relpath,
    validate_artifact_dir,
)
from mergeflow.formats.manifest import Manifest, TensorInfo
from mergeflow.io.fs import FileStamp
from mergeflow.io.session import sha256_file
from mergeflow.outputs.registry import output_of
from mergeflow.records import MergePlan, ValidationReport, VerifiedFile


def check_inputs_unchanged(plan: MergePlan) -> None:
    """Every input file still has the size and timestamps it had when the export planned it."""
    for path, stamp in plan.input_stamps.items():
        try:
            now = FileStamp.of(Path(path))
        except FileNotFoundError:
            raise InputChangedError(f"input {Path(path).name} disappeared during the export") from None
        if now != stamp:
            raise InputChangedError(f"input {Path(path).name} changed during the export; rerun once it is stable")


def check_loadable(plan: MergePlan, tensors: Mapping[str, TensorInfo]) -> None:
    """What the output needs to load: for a model, the staged config builds the class with exactly these tensors."""
    output_of(plan).check_staged(plan, tensors)


def validate_staged(plan: MergePlan, manifest: Manifest,
                    verified: Mapping[str, VerifiedFile] | None = None) -> ValidationReport:
    """Layer 4 on the staging tree: inputs unchanged, loadable, and everything `test` checks.

    `verified` maps paths relative to the artifact root to the digests the shard writers
    proved (see artifact_check.check_tree_and_hashes).
    """
    check_inputs_unchanged(plan)
    check_loadable(plan, manifest.tensors)
    artifact = Path(plan.output.artifact_dir)
    summary = validate_artifact_dir(artifact, verified)
    return ValidationReport(
        artifact_dir=plan.output.artifact_dir,
        manifest_sha256=sha256_file(artifact / manifest_relpath(artifact)),
        architecture=summary.architecture,
        files_checked=summary.files,
        tensors_checked=summary.tensors,
        layers=dict(manifest.verification),
    )
