"""Flows that upload or verify an already published artifact (`mergeflow upload|verify-upload`)."""

from __future__ import annotations

from pathlib import Path

from mergeflow.config import UploadSummary
from mergeflow.flows.heartbeats import skip_heartbeat_join
from mergeflow.flows.prefect_flow import flow
from mergeflow.tasks.upload import upload_to_hub, verify_hub_upload
from mergeflow.tasks.validate import validate_artifact_task

skip_heartbeat_join()  # a flow run ends without waiting for its heartbeat thread (flows/heartbeats.py)


@flow(name="mergeflow-upload", flow_run_name="upload-{hf_upload_path}")
def upload_flow(test_hf_dir: str, hf_upload_path: str, private: bool = False) -> UploadSummary:
    """Validate the local artifact, then upload and verify it on the Hub."""
    path = str(Path(test_hf_dir).expanduser().resolve())
    validate_artifact_task(path)
    return upload_to_hub(path, hf_upload_path, private)


@flow(name="mergeflow-verify-upload", flow_run_name="verify-upload-{hf_upload_path}")
def verify_upload_flow(test_hf_dir: str, hf_upload_path: str, revision: str | None = None) -> UploadSummary:
    """Compare a Hub repo with a local artifact's manifest, file by file."""
    return verify_hub_upload(str(Path(test_hf_dir).expanduser().resolve()), hf_upload_path, revision)
