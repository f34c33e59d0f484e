"""Checks that several outputs compose: weight files against the manifest, configs, the staged schema.

Moved here from export/check/artifact_check.py and export/check/staged_check.py so each output names the
ones it runs; nothing here asks which output it checks.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from mergeflow.errors import ArtifactInvalidError
from mergeflow.formats.manifest import ManifestDocument, TensorJson
from mergeflow.formats.safetensors_format import nbytes
from mergeflow.formats.weight_index import WEIGHT_NAMES, has_weights, read_weights
from mergeflow.io.config_paths import is_config_json
from mergeflow.io.jsonfiles import read_json_strict

if TYPE_CHECKING:
    from collections.abc import Mapping

    from mergeflow.formats.manifest import TensorInfo
    from mergeflow.records import MergePlan


def check_weights(tensor_dir: Path, rel_prefix: str, tensors: Mapping[str, TensorJson],
                  weights_names: tuple[str, ...] = WEIGHT_NAMES) -> int:
    """The weight files (single or indexed, under one of `weights_names`) hold exactly the manifest's tensors."""
    weights_name = next((name for name in weights_names if has_weights(tensor_dir, name)), None)
    if weights_name is None:
        raise ArtifactInvalidError(f"{rel_prefix or '.'}/ holds no weights file")
    stored = read_weights(tensor_dir, weights_name, ArtifactInvalidError, "the artifact")
    # mergeflow's writer promises more than a base must keep: `format: pt` (what Diffusers and
    # Transformers expect of a torch file) and an index total_size equal to the shards' bytes.
    for file_name, metadata in sorted(stored.metadata.items()):
        if metadata.get("format") != "pt":
            raise ArtifactInvalidError(f"{file_name}: header metadata lacks format 'pt'")
    found = stored.headers()
    if stored.index is not None:
        total = stored.total_size
        if not isinstance(total, int) or isinstance(total, bool):
            raise ArtifactInvalidError(f"{stored.index} must hold metadata.total_size and weight_map")
        if total != sum(nbytes(d, s) for d, s in found.values()):
            raise ArtifactInvalidError(f"{stored.index} total_size {total} does not match the shards")
    if set(found) != set(tensors):
        extra, missing = sorted(set(found) - set(tensors)), sorted(set(tensors) - set(found))
        raise ArtifactInvalidError(f"weights and manifest disagree on the tensor set (extra {extra[:3]}, missing {missing[:3]})")
    for key, (dtype, shape) in found.items():
        info = tensors[key]
        if info["dtype"] != dtype or list(shape) != info["shape"]:
            raise ArtifactInvalidError(f"{key} is {dtype}{list(shape)} in the weights but {info['dtype']}{info['shape']} in the manifest")
    return len(found)


def check_manifest_tensors(root: Path, manifest: ManifestDocument, weights_names: tuple[str, ...] = WEIGHT_NAMES) -> int:
    """`check_weights` on the manifest's tensor directory (no tensors listed: nothing to read)."""
    tensor_dir = root / manifest["tensor_directory"]
    prefix = "" if manifest["tensor_directory"] == "." else manifest["tensor_directory"]
    return check_weights(tensor_dir, prefix, manifest["tensors"], weights_names) if manifest["tensors"] else 0


def check_root_class(root: Path, manifest: ManifestDocument) -> None:
    """The root config.json names the manifest's architecture (a standalone model)."""
    data = read_json_strict(root / "config.json", ArtifactInvalidError, "config.json")
    if not isinstance(data, dict) or data.get("_class_name") != manifest["architecture"]:
        raise ArtifactInvalidError(f"config.json names {data.get('_class_name') if isinstance(data, dict) else None!r}, "
                                   f"but the manifest says {manifest['architecture']!r}")


def check_model_configs(root: Path, manifest: ManifestDocument) -> None:
    """The tensor directory has its config.json; no config leaks a local path."""
    tensor_dir = root / manifest["tensor_directory"]
    if not (tensor_dir / "config.json").is_file():
        raise ArtifactInvalidError(f"{manifest['tensor_directory']}/config.json is missing")
    for rel in manifest["files"]:
        if is_config_json(rel):
            cfg = read_json_strict(root / rel, ArtifactInvalidError, rel)
            if isinstance(cfg, dict) and ("_name_or_path" in cfg or "name_or_path" in cfg):
                raise ArtifactInvalidError(f"{rel} still holds _name_or_path (a local path)")


def check_schema_loadable(plan: MergePlan, tensors: Mapping[str, TensorInfo]) -> None:
    """What from_pretrained needs: the staged config builds the class with exactly these tensors."""
    from mergeflow.architectures.schema import (  # diffusers, unless the schema is cached
        model_schema,
        read_model_config,
    )

    if plan.conversion.output_shapes is not None:  # a converted or remote-code schema, fixed at inspect
        if {k: list(v) for k, v in plan.conversion.output_shapes.items()} != {k: list(v.shape) for k, v in tensors.items()}:
            raise ArtifactInvalidError("the staged weights do not match the schema planned for this artifact")
        return
    config = read_model_config(Path(plan.output.tensor_dir) / "config.json", ArtifactInvalidError, "staged config.json")
    want = {k: list(v) for k, v in model_schema(plan.output.transformer_class, config).tensors.items()}
    have = {k: list(v.shape) for k, v in tensors.items()}
    if want != have:
        raise ArtifactInvalidError("the staged weights do not match what the staged config builds")
