"""Uploading a published artifact to the Hugging Face Hub, as retryable Prefect tasks."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.artifacts import create_link_artifact

from mergeflow.config import UploadSummary


def _link(record: UploadSummary) -> None:
    key = "hub-" + "".join(c if c.isalnum() else "-" for c in record["repo_id"].lower()).strip("-")
    create_link_artifact(link=record["url"], link_text=f"{record['repo_id']} @ {record['commit_sha'][:10]}", key=key[:100],
                         description="The uploaded, verified artifact on the Hugging Face Hub")


# The token is never a task parameter (Prefect records parameters): huggingface_hub reads
# HF_TOKEN or the stored login itself. No Prefect retries: every Hub call already goes through
# mergeflow.hub.retry.call_with_retries (transient errors only, Retry-After honoured), the one
# retry policy for uploads; a second loop around it multiplied the attempts (5 inside each of 3).
@task(name="upload-to-hub", task_run_name="upload-{repo_id}")
def upload_to_hub(artifact_dir: str, repo_id: str, private: bool = False) -> UploadSummary:
    """Upload the published artifact as one commit and verify every file on the Hub."""
    from mergeflow.hub.upload import upload_artifact

    record = upload_artifact(Path(artifact_dir), repo_id, private=private).to_dict()
    _link(record)
    return record


@task(name="verify-upload", task_run_name="verify-upload-{repo_id}")
def verify_hub_upload(artifact_dir: str, repo_id: str, revision: str | None = None) -> UploadSummary:
    """Check that the Hub repo holds exactly the artifact's files (sizes and sha256)."""
    from mergeflow.hub.upload import verify_upload

    return verify_upload(Path(artifact_dir), repo_id, revision=revision).to_dict()
