"""Validation: the checks `test` runs on any artifact, and the checks of a staged export."""

from __future__ import annotations

import os
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from mergeflow.errors import InputChangedError, ValidationError
from mergeflow.fsops import FileStamp, sha256_file
from mergeflow.jsonfiles import read_json_strict
from mergeflow.lora_artifact import ADAPTER_DIR, ADAPTER_MANIFEST, adapter_only_root, check_adapter_weights
from mergeflow.manifest import MANIFEST_NAME, check_manifest
from mergeflow.paths import check_relative_name
from mergeflow.pipeline_contract import check_pipeline_artifact
from mergeflow.config_paths import is_config_json
from mergeflow.records import MergePlan, ValidationReport, VerifiedFile
from mergeflow.safetensors_format import nbytes, read_header

WEIGHT_NAMES = ("diffusion_pytorch_model.safetensors", "model.safetensors")


@dataclass(frozen=True)
class ArtifactSummary:
    architecture: str
    artifact_type: str
    files: int
    tensors: int
    manifest: dict[str, Any]


def list_tree(root: Path) -> list[str]:
    """Every file under root as a relative POSIX path; symlinks and special files are refused."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            full = Path(dirpath) / name
            if full.is_symlink():
                raise ValidationError(f"{full.relative_to(root)} is a symlink; artifacts hold plain files only")
        for name in filenames:
            full = Path(dirpath) / name
            if not full.is_file():
                raise ValidationError(f"{full.relative_to(root)} is not a regular file")
            found.append(full.relative_to(root).as_posix())
    return sorted(found)


def check_tree_and_hashes(root: Path, files: dict[str, str], *, verified: Mapping[str, VerifiedFile] | None = None,
                          workers: int = 4) -> None:
    """The file tree equals the manifest's list exactly and every sha256 matches.

    `verified` (staged exports only) names files whose digest this export proved from their
    bytes: such a file is taken as read while its stamp is unchanged since; every other file,
    and every file of a published artifact, is hashed here.
    """
    present = set(list_tree(root)) - {MANIFEST_NAME}
    listed = set(files)
    if present - listed:
        raise ValidationError(f"{sorted(present - listed)[0]} is in the artifact but not in the manifest")
    if listed - present:
        raise ValidationError(f"{sorted(listed - present)[0]} is listed in the manifest but missing")
    digests = {name: v.sha256 for name, v in (verified or {}).items() if name in listed and _unchanged(root / name, v)}
    names = sorted(listed - set(digests), key=lambda n: -(root / n).stat().st_size)
    with ThreadPoolExecutor(max_workers=workers) as pool:
        digests.update(zip(names, pool.map(lambda n: sha256_file(root / n), names)))
    for name in sorted(listed):
        if digests[name] != files[name]:
            raise ValidationError(f"{name} does not match its sha256 in the manifest: the file was changed or damaged")


def _unchanged(path: Path, verified: VerifiedFile) -> bool:
    try:
        return FileStamp.of(path) == verified.stamp
    except FileNotFoundError:
        return False


def check_weights(tensor_dir: Path, rel_prefix: str, tensors: dict[str, Any]) -> int:
    """The weight files (single or indexed) hold exactly the manifest's tensors."""
    for weights_name in WEIGHT_NAMES:
        single, index = tensor_dir / weights_name, tensor_dir / f"{weights_name}.index.json"
        if single.is_file() or index.is_file():
            break
    else:
        raise ValidationError(f"{rel_prefix or '.'}/ holds no weights file")
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    if index.is_file():
        data = read_json_strict(index, ValidationError, index.name)
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        total = (data.get("metadata") or {}).get("total_size") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not isinstance(total, int):
            raise ValidationError(f"{index.name} must hold metadata.total_size and weight_map")
        for file_name in sorted(set(weight_map.values())):
            check_relative_name(file_name, index.name)
            entries = _shard_entries(tensor_dir / file_name)
            for key, (dtype, shape) in entries.items():
                if weight_map.get(key) != file_name:
                    raise ValidationError(f"{file_name} holds {key}, which {index.name} places elsewhere")
                found[key] = (dtype, shape)
        if set(weight_map) != set(found):
            raise ValidationError(f"{index.name} lists tensors that no shard holds")
        if total != sum(nbytes(d, s) for d, s in found.values()):
            raise ValidationError(f"{index.name} total_size {total} does not match the shards")
        if single.exists():
            raise ValidationError(f"both {single.name} and {index.name} exist")
    else:
        found = _shard_entries(single)
    if set(found) != set(tensors):
        extra, missing = sorted(set(found) - set(tensors)), sorted(set(tensors) - set(found))
        raise ValidationError(f"weights and manifest disagree on the tensor set (extra {extra[:3]}, missing {missing[:3]})")
    for key, (dtype, shape) in found.items():
        info = tensors[key]
        if info["dtype"] != dtype or list(shape) != info["shape"]:
            raise ValidationError(f"{key} is {dtype}{list(shape)} in the weights but {info['dtype']}{info['shape']} in the manifest")
    return len(found)


def _shard_entries(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    if not path.is_file():
        raise ValidationError(f"weight file {path.name} is missing")
    entries, metadata, _ = read_header(path)
    if metadata.get("format") != "pt":
        raise ValidationError(f"{path.name}: header metadata lacks format 'pt'")
    return {k: (e.dtype, e.shape) for k, e in entries.items()}


def check_configs(root: Path, manifest: dict[str, Any]) -> None:
    """The root config names the manifest's architecture; no config leaks a local path."""
    if manifest["artifact_type"] == "peft_adapter":
        return
    if manifest["artifact_type"] in ("diffusers_pipeline", "minimax_h3_pipeline"):
        check_pipeline_artifact(root, manifest)  # the (modular) model_index.json and every declared component
    else:
        data = read_json_strict(root / "config.json", ValidationError, "config.json")
        if not isinstance(data, dict) or data.get("_class_name") != manifest["architecture"]:
            raise ValidationError(f"config.json names {data.get('_class_name') if isinstance(data, dict) else None!r}, "
                                  f"but the manifest says {manifest['architecture']!r}")
    tensor_dir = root / manifest["tensor_directory"]
    if not (tensor_dir / "config.json").is_file():
        raise ValidationError(f"{manifest['tensor_directory']}/config.json is missing")
    for rel in manifest["files"]:
        if is_config_json(rel):
            cfg = read_json_strict(root / rel, ValidationError, rel)
            if isinstance(cfg, dict) and ("_name_or_path" in cfg or "name_or_path" in cfg):
                raise ValidationError(f"{rel} still holds _name_or_path (a local path)")


def manifest_relpath(root: Path) -> str:
    """Where an artifact's manifest is: at its root, or in lora_adapter/ for a LoRA-only adapter export."""
    return ADAPTER_MANIFEST if adapter_only_root(root) is not None else MANIFEST_NAME


def validate_artifact_dir(root: Path, verified: Mapping[str, VerifiedFile] | None = None) -> ArtifactSummary:
    """Everything `test` checks, without the source checkpoint (`verified`: see check_tree_and_hashes)."""
    if not root.is_dir():
        raise ValidationError(f"{root} is not a directory")
    adapter_only = adapter_only_root(root)
    if adapter_only is not None:
        return validate_artifact_dir(adapter_only, _below(verified, adapter_only.relative_to(root).as_posix()))
    manifest_path = root / MANIFEST_NAME
    if manifest_path.is_symlink() or not manifest_path.is_file():
        raise ValidationError(f"{root.name} has no {MANIFEST_NAME}; is it a mergeflow artifact?")
    manifest = check_manifest(read_json_strict(manifest_path, ValidationError, MANIFEST_NAME))
    check_tree_and_hashes(root, manifest["files"], verified=verified)
    check_configs(root, manifest)
    tensor_dir = root / manifest["tensor_directory"]
    prefix = "" if manifest["tensor_directory"] == "." else manifest["tensor_directory"]
    if manifest["artifact_type"] == "peft_adapter":
        count = check_adapter_weights(root, manifest)
    else:
        count = check_weights(tensor_dir, prefix, manifest["tensors"]) if manifest["tensors"] else 0
    if ADAPTER_MANIFEST in manifest["files"]:  # an exported adapter beside the model: an artifact of its own
        if validate_artifact_dir(root / ADAPTER_DIR, _below(verified, ADAPTER_DIR)).artifact_type != "peft_adapter":
            raise ValidationError(f"{ADAPTER_DIR}/ holds an artifact that is not a peft_adapter")
    return ArtifactSummary(manifest["architecture"], manifest["artifact_type"], len(manifest["files"]) + 1, count, manifest)


def _below(verified: Mapping[str, VerifiedFile] | None, prefix: str) -> dict[str, VerifiedFile] | None:
    """The entries of `verified` inside directory `prefix`, relative to it."""
    if not verified:
        return None
    return {name.removeprefix(f"{prefix}/"): v for name, v in verified.items() if name.startswith(f"{prefix}/")}


def check_inputs_unchanged(plan: MergePlan) -> None:
    """Every input file still has the size and timestamps it had when the export planned it."""
    for path, stamp in plan.input_stamps.items():
        try:
            now = FileStamp.of(Path(path))
        except FileNotFoundError:
            raise InputChangedError(f"input {Path(path).name} disappeared during the export") from None
        if now != stamp:
            raise InputChangedError(f"input {Path(path).name} changed during the export; rerun once it is stable")


def check_loadable(plan: MergePlan, tensors: dict[str, Any]) -> None:
    """What from_pretrained needs: the staged config builds the class with exactly these tensors."""
    from mergeflow.schema import diffusers_model_class, expected_tensors, meta_model, read_model_config

    if plan.artifact_type != "diffusers_transformer" and plan.tensor_directory == ".":
        return
    if plan.extras.get("output_shapes") is not None:  # a converted or remote-code schema, fixed at inspect
        if {k: list(v) for k, v in plan.extras["output_shapes"].items()} != {k: v["shape"] for k, v in tensors.items()}:
            raise ValidationError("the staged weights do not match the schema planned for this artifact")
        return
    config = read_model_config(Path(plan.tensor_dir) / "config.json", ValidationError, "staged config.json")
    model = meta_model(diffusers_model_class(plan.transformer_class), config)
    want = {k: list(v.shape) for k, v in expected_tensors(model).items()}
    have = {k: v["shape"] for k, v in tensors.items()}
    if want != have:
        raise ValidationError("the staged weights do not match what the staged config builds")


def validate_staged(plan: MergePlan, manifest: dict[str, Any],
                    verified: Mapping[str, VerifiedFile] | None = None) -> ValidationReport:
    """Layer 4 on the staging tree: inputs unchanged, loadable, and everything `test` checks.

    `verified` maps paths relative to the artifact root to the digests the shard writers
    proved (see check_tree_and_hashes).
    """
    check_inputs_unchanged(plan)
    check_loadable(plan, manifest["tensors"])
    summary = validate_artifact_dir(Path(plan.artifact_dir), verified)
    return ValidationReport(
        artifact_dir=plan.artifact_dir,
        manifest_sha256=sha256_file(Path(plan.artifact_dir) / manifest_relpath(Path(plan.artifact_dir))),
        architecture=summary.architecture,
        files_checked=summary.files,
        tensors_checked=summary.tensors,
        layers=dict(manifest["verification"]),
    )


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

