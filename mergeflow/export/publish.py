"""Finishing an export: configs, index and manifest into staging, then the atomic publish."""

from __future__ import annotations

import shutil
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path, PurePosixPath
from typing import Any

from mergeflow.errors import ArtifactInvalidError
from mergeflow.export.check.artifact_check import list_tree, manifest_relpath
from mergeflow.export.write.shard_writer import (
    write_component_config,
    write_weight_index,
)
from mergeflow.formats.manifest import (
    MANIFEST_NAME,
    ConfigTransform,
    LoraFusion,
    Manifest,
    SourceModelConfig,
    TensorInfo,
    UnchangedMeasurement,
    producer_versions,
)
from mergeflow.formats.seal import SIGNATURE_NAME, write_pin
from mergeflow.hub.model_card import CARD_NAME, CardFacts, card_record, render
from mergeflow.io.fs import fsync_dir, make_readable, rename_noreplace
from mergeflow.io.jsonfiles import write_bytes_durable, write_json_durable
from mergeflow.io.session import sha256_file
from mergeflow.outputs.registry import output_of
from mergeflow.records import (
    FileRecord,
    MergePlan,
    OutputPlan,
    SealRecord,
    ShardRecord,
    ValidationReport,
)
from mergeflow.signing import sign_artifact
from mergeflow.sources.registry import source_named

LAYERS_PASSED = {"structure": "passed", "source_round_trip": "passed", "artifact_round_trip": "passed",
                 "integrity": "passed", "runtime": "not_run"}


def write_metadata_files(plan: MergePlan, output: OutputPlan) -> tuple[list[FileRecord], ConfigTransform]:
    """The component config (path keys removed) and the weight index, hashed as written."""
    tensor_dir = Path(plan.output.tensor_dir)
    raw, removed = write_component_config(Path(plan.base.component_dir) / "config.json", tensor_dir / "config.json",
                                          plan.base.base_dir)
    records = [FileRecord(plan.output.relative("config.json"), sha256_file(tensor_dir / "config.json"), len(raw), "written")]
    index = write_weight_index(output, plan.output.weights_name, tensor_dir)
    if index is not None:
        name = f"{plan.output.weights_name}.index.json"
        records.append(FileRecord(plan.output.relative(name), sha256_file(tensor_dir / name), len(index), "written"))
    return records, config_transform_record(plan, removed)


def config_transform_record(plan: MergePlan, trained_removed: list[str]) -> ConfigTransform:
    """Manifest config_transform: local-path keys removed per config, the tensor conversion, base files left out."""
    removed = {plan.output.relative("config.json"): trained_removed} if trained_removed else {}
    removed.update(plan.conversion.config_changes)  # copied configs (computed at inspect, re-checked on copy)
    conversion = plan.conversion
    return ConfigTransform(
        removed_keys=dict(sorted(removed.items())),
        tensor_conversion={"adapter": conversion.adapter, **conversion.adapter_params} if conversion.adapter else None,
        not_copied=dict(sorted(conversion.not_copied.items())) if conversion.not_copied else None,
    )


def build_manifest(
    plan: MergePlan,
    rank_digests: dict[str, str],
    shards: list[ShardRecord],
    files: list[FileRecord],
    config_transform: ConfigTransform,
    lora_fusion: LoraFusion | None = None,
    unchanged: UnchangedMeasurement | None = None,
) -> Manifest:
    """The manifest of SPEC section 5, built from records only (no absolute paths).

    rank_digests maps every rank file name to its sha256 (see mergeflow.sources.verl_ranks.hash_rank_file).
    """
    if set(rank_digests) != set(plan.checkpoint.rank_files):
        raise ArtifactInvalidError("the rank files hashed for the manifest are not the checkpoint's rank files")
    source_files = {name: rank_digests[name] for name in plan.checkpoint.rank_files}  # a DCP's: .metadata + *.distcp
    # the source's marker files (verl: fsdp_config.json), after the hashed ones
    source_files.update(source_named(plan.checkpoint.format).marker_digests(Path(plan.checkpoint.actor_dir)))
    if plan.lora is not None:
        source_files.update(plan.lora.source_files)  # lora_train_meta.json (and adapter_config.json)
    tensors = {name: TensorInfo(tuple(shape), dtype) for s in shards for name, (dtype, shape) in s.tensors.items()}
    out_files = {plan.output.relative(s.file_name): s.sha256 for s in shards}
    out_files.update({f.rel_path: f.sha256 for f in files})
    ranges = {plan.output.relative(s.file_name): s.ranges for s in shards if s.ranges is not None}
    ranges.update({f.rel_path: f.ranges for f in files if f.ranges is not None})
    return Manifest(
        artifact_type=plan.output.artifact_type,
        architecture=plan.output.architecture,
        trained_components=(plan.output.component,),
        tensor_directory=plan.output.tensor_directory,
        dtype=plan.options.dtype,
        max_shard_size_bytes=plan.options.max_shard_size,
        source_files=source_files,
        source_model_config=SourceModelConfig(plan.checkpoint.config_sha256, plan.checkpoint.config_logical_path),
        base_files=dict(plan.base.files),
        files=dict(sorted(out_files.items())),
        tensors=dict(sorted(tensors.items())),
        config_transform=config_transform,
        producer=producer_versions(),
        verification=dict(LAYERS_PASSED),
        checkpoint=source_named(plan.checkpoint.format).checkpoint_record(plan.checkpoint),
        lora_fusion=lora_fusion,
        unchanged_check=unchanged,
        original_layout=output_of(plan).manifest_layout_record(plan, shards),
        quantization=output_of(plan).manifest_quantization_record(plan),
        file_ranges=dict(sorted(ranges.items())) or None,
    )


def finalize_staging(plan: MergePlan, output: OutputPlan, rank_digests: dict[str, str], shards: list[ShardRecord],
                     extra_files: list[FileRecord] | None = None, lora_fusion: LoraFusion | None = None,
                     unchanged: UnchangedMeasurement | None = None) -> Manifest:
    """Write the remaining files and the manifest into the staging artifact (extra_files: e.g. lora_adapter/).

    The manifest is serialized here, once: every check that adds to it (the unchanged-weights guard) ran before.
    """
    files, transform = write_metadata_files(plan, output)
    manifest = build_manifest(plan, rank_digests, shards, files + list(extra_files or []), transform, lora_fusion,
                              unchanged)
    manifest = write_model_card(plan, manifest, Path(plan.output.artifact_dir), plan.output.weights_name)
    write_json_durable(Path(plan.output.artifact_dir) / MANIFEST_NAME, manifest.to_json(), indent=2)
    return manifest


def write_model_card(plan: MergePlan, manifest: Manifest, root: Path, weights_file: str,
                     runtime: Mapping[str, Any] | None = None) -> Manifest:
    """README.md into the staged artifact at `root`; the manifest returned lists it and carries its record.

    Written before the manifest is serialized, so the manifest's digest of it (and a signature over the
    staged tree) covers the card; rewritten with the runtime check's result when that runs.
    """
    facts = CardFacts.of(plan.checkpoint.actor_dir, plan.base.hub_id, weights_file, plan.output.transformer_class)
    manifest = replace(manifest, model_card=card_record(manifest, facts))
    raw = render(manifest, facts, runtime).encode()
    write_bytes_durable(root / CARD_NAME, raw)
    files = {**manifest.files, CARD_NAME: sha256_file(root / CARD_NAME)}
    return replace(manifest, files=dict(sorted(files.items())))


def record_runtime(plan: MergePlan, manifest: Manifest, root: Path, weights_file: str,
                   runtime: Mapping[str, Any]) -> Manifest:
    """The runtime check passed on the staged artifact at `root`: its record into the card and the manifest.

    Before validation and publication, so the published manifest (and any signature over the staging tree)
    holds the result; a failed check never reaches here (nothing is published).
    """
    manifest = replace(manifest, verification={**manifest.verification, "runtime": "passed"}, runtime=dict(runtime))
    manifest = write_model_card(plan, manifest, root, weights_file, runtime)
    write_json_durable(root / MANIFEST_NAME, manifest.to_json(), indent=2)
    return manifest


def seal_staged(plan: MergePlan, report: ValidationReport) -> SealRecord:
    """After validation, the last writes into staging: the manifest's pin, then (with a key) the signature.

    The pin names the digest validation proved; the signature, written last, covers every file, manifest
    and pin included. Both are rewritten on every run, so a resumed staging is sealed like a fresh one
    (an ECDSA signature differs at each signing; what it signs does not).
    """
    artifact = Path(plan.output.artifact_dir)
    home = artifact / PurePosixPath(manifest_relpath(artifact)).parent  # beside the manifest: lora_adapter/ alone
    (home / SIGNATURE_NAME).unlink(missing_ok=True)  # an earlier attempt's: re-signed below, or not at all
    if sha256_file(home / MANIFEST_NAME) != report.manifest_sha256:
        raise ArtifactInvalidError("the staged manifest changed after validation; nothing was published")
    write_pin(home, report.manifest_sha256)
    signed_by = None
    if plan.options.sign_key:
        work = Path(plan.output.work_dir)
        work.mkdir(parents=True, exist_ok=True)
        signed_by = sign_artifact(home, plan.options.sign_key, Path(plan.output.target).name, work)
    return SealRecord(manifest_sha256=report.manifest_sha256, signed_by=signed_by)


def publish_staged(plan: MergePlan, report: ValidationReport, seal: SealRecord) -> dict[str, str]:
    """Final self-check, normal permissions, then rename into place without ever replacing."""
    artifact = Path(plan.output.artifact_dir)
    target = Path(plan.output.target)
    manifest_rel = manifest_relpath(artifact)
    if sha256_file(artifact / manifest_rel) != report.manifest_sha256 or seal.manifest_sha256 != report.manifest_sha256:
        raise ArtifactInvalidError("the staged manifest changed after validation; nothing was published")
    if len(list_tree(artifact)) != report.files_checked + seal.files_added:
        raise ArtifactInvalidError("the staged tree changed after validation; nothing was published")
    make_readable(artifact)
    rename_noreplace(artifact, target)
    # A kill from here on leaves the staging dir and the lock: the next command clears them.
    fsync_dir(target.parent)
    shutil.rmtree(plan.output.staging, ignore_errors=True)
    return {"output_dir": str(target), "manifest_path": str(target / manifest_rel)}
