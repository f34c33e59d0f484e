"""Prefect artifacts of a merge: progress while it runs, then the manifest table and a summary."""

from __future__ import annotations

from uuid import UUID

from prefect.artifacts import (
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from mergeflow.io.jsonfiles import JsonObject
from mergeflow.records import MergePlan


def artifact_key(prefix: str, name: str) -> str:
    """Artifact keys allow lowercase letters, digits and dashes only."""
    cleaned = "".join(c if c.isalnum() else "-" for c in name.lower()).strip("-")
    return f"{prefix}-{cleaned}"[:100].rstrip("-")


def start_progress(plan: MergePlan, total_shards: int) -> UUID | None:
    return create_progress_artifact(
        progress=0.0,
        key=artifact_key("merge-progress", plan.output.target.rsplit("/", 1)[-1]),
        description=f"Shards written and verified (of {total_shards})",
    )


def report_progress(artifact_id: UUID | None, done: int, total: int) -> None:
    if artifact_id is not None:
        update_progress_artifact(artifact_id=artifact_id, progress=100.0 * done / max(total, 1))


def publish_manifest_artifacts(plan: MergePlan, manifest: JsonObject, output_dir: str) -> None:
    """The manifest as a table (one row per file) and a markdown summary of the export."""
    name = plan.output.target.rsplit("/", 1)[-1]
    rows = [{"file": rel, "sha256": digest} for rel, digest in manifest["files"].items()]
    create_table_artifact(table=rows, key=artifact_key("merge-manifest", name), description="Files of the published artifact and their sha256")
    total = sum(
        _numel(info["shape"]) * _itemsize(info["dtype"]) for info in manifest["tensors"].values()
    )
    layers = ", ".join(f"{k}: {v}" for k, v in manifest["verification"].items())
    markdown = "\n".join([
        f"# Merged {manifest['architecture']}",
        "",
        "| field | value |",
        "|---|---|",
        f"| output | `{output_dir}` |",
        f"| artifact type | {manifest['artifact_type']} |",
        f"| world size | {plan.checkpoint.world_size} (FSDP v{plan.checkpoint.fsdp_version}) |",
        f"| tensors | {len(manifest['tensors'])} ({total / 1e6:.1f} MB) |",
        f"| files | {len(manifest['files']) + 1} |",
        f"| dtype policy | {manifest['dtype']} |",
        f"| verification | {layers} |",
        f"| source fingerprint | `{manifest['source_fingerprint'][:16]}` |",
    ])
    create_markdown_artifact(markdown=markdown, key=artifact_key("merge-summary", name), description="Export summary")


def _numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: str) -> int:
    from mergeflow.formats.safetensors_format import DTYPES

    return DTYPES[dtype][1]
