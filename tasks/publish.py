"""Finishing an export: configs, index and manifest into staging, then the atomic publish."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from mergeflow.errors import ValidationError
from mergeflow.fsops import fsync_dir, make_readable, rename_noreplace, sha256_file
from mergeflow.jsonfiles import write_json_durable
from mergeflow.manifest import MANIFEST_NAME, SCHEMA_VERSION, fingerprint, producer_versions
from mergeflow.records import FileRecord, MergePlan, OutputPlan, ShardRecord, ValidationReport
from mergeflow.tasks.validate import list_tree, manifest_relpath
from mergeflow.export.shard_writer import write_component_config, write_weight_index

LAYERS_PASSED = {"structure": "passed", "source_round_trip": "passed", "artifact_round_trip": "passed",
                 "integrity": "passed", "runtime": "not_run"}


def relative_to_artifact(plan: MergePlan, name: str) -> str:
    """Where a file of the tensor directory lies relative to the artifact root."""
    return name if plan.tensor_directory == "." else f"{plan.tensor_directory}/{name}"


def write_metadata_files(plan: MergePlan, output: OutputPlan) -> tuple[list[FileRecord], dict[str, Any]]:
    """The component config (path keys removed) and the weight index, hashed as written."""
    tensor_dir = Path(plan.tensor_dir)
    raw, removed = write_component_config(Path(plan.base_component_dir) / "config.json", tensor_dir / "config.json")
    records = [FileRecord(relative_to_artifact(plan, "config.json"), sha256_file(tensor_dir / "config.json"), len(raw), "written")]
    index = write_weight_index(output, plan.weights_name, tensor_dir)
    if index is not None:
        name = f"{plan.weights_name}.index.json"
        records.append(FileRecord(relative_to_artifact(plan, name), sha256_file(tensor_dir / name), len(index), "written"))
    return records, config_transform_record(plan, removed)


def config_transform_record(plan: MergePlan, trained_removed: list[str]) -> dict[str, Any]:
    """Manifest config_transform: local-path keys removed per config, the tensor conversion, base files left out."""
    removed = {relative_to_artifact(plan, "config.json"): trained_removed} if trained_removed else {}
    removed.update(plan.extras.get("config_changes", {}))  # copied configs (computed at inspect, re-checked on copy)
    record: dict[str, Any] = {"removed_keys": dict(sorted(removed.items()))}
    if plan.extras.get("adapter"):
        record["tensor_conversion"] = {"adapter": plan.extras["adapter"], **plan.extras.get("adapter_params", {})}
    if plan.extras.get("not_copied"):
        record["not_copied"] = dict(sorted(plan.extras["not_copied"].items()))
    return record


def build_manifest(
    plan: MergePlan,
    rank_digests: dict[str, str],
    shards: list[ShardRecord],
    files: list[FileRecord],
    config_transform: dict[str, Any],
    lora_fusion: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The manifest of SPEC section 5, built from records only (no absolute paths).

    rank_digests maps every rank file name to its sha256 (see tasks/load.hash_rank).
    """
    if set(rank_digests) != set(plan.rank_files):
        raise ValidationError("the rank files hashed for the manifest are not the checkpoint's rank files")
    source_files = {name: rank_digests[name] for name in plan.rank_files}
    source_files["fsdp_config.json"] = sha256_file(Path(plan.actor_dir) / "fsdp_config.json")
    if plan.lora is not None:
        source_files.update(plan.lora["source_files"])  # lora_train_meta.json (and adapter_config.json)
    smc = {"sha256": plan.source_config_sha256, "logical_path": "huggingface/config.json"}
    tensors = {name: {"shape": list(shape), "dtype": dtype} for s in shards for name, (dtype, shape) in s.tensors.items()}
    out_files = {relative_to_artifact(plan, s.file_name): s.sha256 for s in shards}
    out_files.update({f.rel_path: f.sha256 for f in files})
    manifest: dict[str, Any] = {
        "schema_version": SCHEMA_VERSION,
        "artifact_type": plan.artifact_type,
        "architecture": plan.architecture,
        "backend": "fsdp",
        "trained_components": [plan.component],
        "tensor_directory": plan.tensor_directory,
        "dtype": plan.config["dtype"],
        "max_shard_size_bytes": plan.config["max_shard_size"],
        "source_files": source_files,
        "source_model_config": smc,
        "source_fingerprint": fingerprint([source_files, smc]),
        "base_files": dict(plan.base_files),
        "base_fingerprint": fingerprint(plan.base_files),
        "files": dict(sorted(out_files.items())),
        "tensors": dict(sorted(tensors.items())),
        "config_transform": config_transform,
        "producer": producer_versions(),
        "verification": dict(LAYERS_PASSED),
        "checkpoint": {"world_size": plan.world_size, "fsdp_version": plan.fsdp_version},
    }
    if lora_fusion is not None:
        manifest["lora_fusion"] = lora_fusion
    return manifest


def finalize_staging(plan: MergePlan, output: OutputPlan, rank_digests: dict[str, str], shards: list[ShardRecord],
                     extra_files: list[FileRecord] | None = None, lora_fusion: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write the remaining files and the manifest into the staging artifact (extra_files: e.g. lora_adapter/)."""
    files, transform = write_metadata_files(plan, output)
    manifest = build_manifest(plan, rank_digests, shards, files + list(extra_files or []), transform, lora_fusion)
    write_json_durable(Path(plan.artifact_dir) / MANIFEST_NAME, manifest, indent=2)
    return manifest


def publish_staged(plan: MergePlan, report: ValidationReport) -> dict[str, str]:
    """Final self-check, normal permissions, then rename into place without ever replacing."""
    artifact = Path(plan.artifact_dir)
    target = Path(plan.target)
    manifest_rel = manifest_relpath(artifact)
    if sha256_file(artifact / manifest_rel) != report.manifest_sha256:
        raise ValidationError("the staged manifest changed after validation; nothing was published")
    if len(list_tree(artifact)) != report.files_checked:
        raise ValidationError("the staged tree changed after validation; nothing was published")
    make_readable(artifact)
    rename_noreplace(artifact, target)
    fsync_dir(target.parent)
    shutil.rmtree(plan.staging, ignore_errors=True)
    return {"output_dir": str(target), "manifest_path": str(target / manifest_rel)}


@task(name="write-metadata", task_run_name="write-metadata", retries=1, retry_delay_seconds=1, cache_policy=NO_CACHE)
def write_metadata(plan: MergePlan, output: OutputPlan, rank_digests: dict[str, str], shards: list[ShardRecord],
                   extra_files: list[FileRecord] | None = None, lora_fusion: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write config, weight index and manifest into staging."""
    return finalize_staging(plan, output, rank_digests, shards, extra_files, lora_fusion)


@task(name="publish", task_run_name="publish", cache_policy=NO_CACHE)
def publish(plan: MergePlan, report: ValidationReport) -> dict[str, str]:
    """Atomically publish the validated staging directory as the target."""
    return publish_staged(plan, report)
