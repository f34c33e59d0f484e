"""The validate flow (`mergeflow test`): re-check any published or staged artifact on its own."""

from __future__ import annotations

from prefect import get_run_logger
from prefect.runtime import flow_run

from mergeflow.export.check.artifact_check import IntegrityResult, artifact_to_check
from mergeflow.flows.heartbeats import skip_heartbeat_join
from mergeflow.flows.prefect_flow import flow
from mergeflow.flows.run_names import validate_label
from mergeflow.io.confinement import confine_read
from mergeflow.tasks.validate import validate_artifact_task, verify_signature_task

skip_heartbeat_join()  # a flow run ends without waiting for its heartbeat thread (flows/heartbeats.py)


def validate_run_name() -> str:
    """`validate-<run>-step<N>` (a kept staging dir: `validate-<its target's label>-staging`)."""
    return f"validate-{validate_label((flow_run.parameters or {}).get('test_hf_dir'))}"


@flow(name="mergeflow-validate", flow_run_name=validate_run_name)
def validate_flow(test_hf_dir: str, within: str | None = None, verify_key: str | None = None) -> IntegrityResult:
    """Validate an artifact (or a failed merge's staging dir) without its source: manifest, tree, hashes, weights.

    Args:
        test_hf_dir: Absolute path of a published artifact (the merge's target dir), or of the kept
            `.<target>.mergeflow-staging-<key>` dir of a failed merge: the artifact staged inside it is checked.
        within: Set by `mergeflow serve` to its target root: a run may only read below it.
        verify_key: Path of an elliptic-curve public key (PEM) on the machine that runs the flow: the
            artifact's OpenSSF model signature (model.sig) must verify with it.
    """
    if within is not None:
        test_hf_dir = confine_read(test_hf_dir, within)  # and read what was checked, not the name again
    if verify_key is not None:  # a bad key is refused before any hashing
        from mergeflow.signing import load_verify_key

        load_verify_key(verify_key)
    # The same checks `mergeflow test` runs in-process; a failed merge's kept staging dir
    # validates as the artifact staged inside it (or is refused when no manifest was written).
    checked = artifact_to_check(test_hf_dir)
    get_run_logger().info("Validating %s", checked)
    summary = validate_artifact_task(str(checked))
    get_run_logger().info("Validated %s: integrity passed (%s)", checked, summary["architecture"])
    result: IntegrityResult = {"integrity": "passed", "architecture": summary["architecture"]}
    if verify_key is not None:
        result["signature"] = verify_signature_task(str(checked), verify_key)
        get_run_logger().info("Signature of %s: %s", checked, result["signature"])
    return result
