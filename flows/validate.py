"""The validate flow (`mergeflow test`): re-check any published or staged artifact on its own."""

from __future__ import annotations

from pathlib import Path

from prefect import flow
from prefect.runtime import flow_run

from mergeflow.export.artifact_check import artifact_to_check
from mergeflow.io.confinement import confine_read
from mergeflow.io.jsonfiles import JsonObject
from mergeflow.tasks.validate import validate_artifact_task


def validate_run_name() -> str:
    path = (flow_run.parameters or {}).get("test_hf_dir") or "artifact"
    return f"validate-{Path(str(path)).name}"


@flow(name="mergeflow-validate", flow_run_name=validate_run_name)
def validate_flow(test_hf_dir: str, within: str | None = None) -> JsonObject:
    """Validate an artifact (or a failed merge's staging dir) without its source: manifest, tree, hashes, weights.

    `within` (set by `mergeflow serve` to its target root) confines what a deployment run may read.
    """
    if within is not None:
        test_hf_dir = confine_read(test_hf_dir, within)  # and read what was checked, not the name again
    # The same checks `mergeflow test` runs in-process; a failed merge's kept staging dir
    # validates as the artifact staged inside it.
    summary = validate_artifact_task(str(artifact_to_check(test_hf_dir)))
    return {"integrity": "passed", "architecture": summary["architecture"]}
