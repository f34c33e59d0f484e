"""merge_manifest.json: building it from records and checking its schema strictly."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection
from importlib import metadata
from typing import Any

from mergeflow.errors import ArtifactInvalidError
from mergeflow.formats.safetensors_format import DTYPES
from mergeflow.io.jsonfiles import JsonObject
from mergeflow.io.paths import check_relative_name

MANIFEST_NAME = "merge_manifest.json"
SCHEMA_VERSION = 1
# The kind of artifact; its values are those of the registered outputs (mergeflow.outputs.registry).
ArtifactType = str
# Optional: present only when the unchanged-weights guard compared every tensor with the base (the
# sample matched), so an ordinary export's manifest is byte-identical to one written without the guard.
UNCHANGED_CHECK = "unchanged_check"
# source_model_config.logical_path: where the exported model config came from, named without a local
# path. A verl checkpoint saves its own; a DCP carries none, so it is the flag's file or the base's.
VERL_CONFIG_PATH = "huggingface/config.json"
FLAG_CONFIG_PATH = "hf_model_config_path/config.json"
BASE_CONFIG_PREFIX = "base_model/"
VERIFICATION_LAYERS = ("structure", "source_round_trip", "artifact_round_trip", "integrity")

_REQUIRED: dict[str, type | tuple[type, ...]] = {
    "schema_version": int,
    "artifact_type": str,
    "architecture": str,
    "backend": str,
    "trained_components": list,
    "tensor_directory": str,
    "dtype": str,
    "max_shard_size_bytes": int,
    "source_files": dict,
    "source_model_config": dict,
    "source_fingerprint": str,
    "base_files": dict,
    "base_fingerprint": str,
    "files": dict,
    "tensors": dict,
    "config_transform": dict,
    "producer": dict,
    "verification": dict,
}


def fingerprint(obj: Any) -> str:
    """sha256 of the canonical JSON of `obj`."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def producer_versions() -> dict[str, str]:
    versions = {}
    for dist in ("mergeflow", "torch", "diffusers", "transformers", "safetensors", "peft", "prefect", "huggingface_hub"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return versions


def _is_sha256(value: object) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


def _check_digest_map(name: str, value: JsonObject) -> None:
    for rel, digest in value.items():
        check_relative_name(rel, f"manifest {name}")
        if not _is_sha256(digest):
            raise ArtifactInvalidError(f"manifest {name}[{rel!r}] is not a sha256 hex digest")


def check_manifest(data: Any, artifact_types: Collection[str] | None = None) -> JsonObject:
    """Schema and types of a manifest; returns it unchanged when valid.

    `artifact_types`: the ones the registered outputs write (`test` passes them; the outputs live
    above this module, so it does not import them).
    """
    if not isinstance(data, dict):
        raise ArtifactInvalidError("merge_manifest.json is not a JSON object")
    for key, typ in _REQUIRED.items():
        if key not in data:
            raise ArtifactInvalidError(f"merge_manifest.json lacks {key!r}")
        value = data[key]
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise ArtifactInvalidError(f"merge_manifest.json: {key} has the wrong type ({type(value).__name__})")
    if data["schema_version"] != SCHEMA_VERSION:
        raise ArtifactInvalidError(f"manifest schema_version {data['schema_version']} is not supported (expected {SCHEMA_VERSION})")
    if artifact_types is not None and data["artifact_type"] not in artifact_types:
        raise ArtifactInvalidError(f"manifest artifact_type {data['artifact_type']!r} is unknown")
    if data["backend"] != "fsdp":
        raise ArtifactInvalidError("manifest backend must be 'fsdp'")
    if data["max_shard_size_bytes"] <= 0:
        raise ArtifactInvalidError("manifest max_shard_size_bytes must be positive")
    if data["tensor_directory"] != ".":
        check_relative_name(data["tensor_directory"], "manifest tensor_directory")
    for name in ("source_files", "base_files", "files"):
        _check_digest_map(name, data[name])
    if not _is_sha256(data["source_fingerprint"]) or not _is_sha256(data["base_fingerprint"]):
        raise ArtifactInvalidError("manifest fingerprints must be sha256 hex digests")
    _check_source_model_config(data["source_model_config"])
    for key, info in data["tensors"].items():
        if not isinstance(info, dict) or not isinstance(info.get("shape"), list) or info.get("dtype") not in DTYPES:
            raise ArtifactInvalidError(f"manifest tensors[{key!r}] must be {{shape: [...], dtype: <torch dtype name>}}")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in info["shape"]):
            raise ArtifactInvalidError(f"manifest tensors[{key!r}].shape must be non-negative integers")
    verification = data["verification"]
    for layer in VERIFICATION_LAYERS:
        if verification.get(layer) != "passed":
            raise ArtifactInvalidError(f"manifest verification.{layer} is not 'passed'")
    _check_unchanged_check(data.get(UNCHANGED_CHECK))
    if MANIFEST_NAME in data["files"]:
        raise ArtifactInvalidError("manifest files must not list the manifest itself")
    _reject_absolute_paths(data)
    return data


def _check_source_model_config(smc: JsonObject) -> None:
    path = smc.get("logical_path")
    from_base = isinstance(path, str) and path.startswith(BASE_CONFIG_PREFIX) and path.endswith("config.json")
    if not _is_sha256(smc.get("sha256")) or not (path in (VERL_CONFIG_PATH, FLAG_CONFIG_PATH) or from_base):
        raise ArtifactInvalidError(f"manifest source_model_config must hold sha256 and a logical_path "
                                   f"({VERL_CONFIG_PATH!r}, {FLAG_CONFIG_PATH!r} or '{BASE_CONFIG_PREFIX}...config.json')")
    if from_base:
        check_relative_name(path, "manifest source_model_config.logical_path")


def _check_unchanged_check(value: Any) -> None:
    """The optional unchanged-weights measurement (mergeflow/export/check/unchanged.py), when present."""
    if value is None:
        return
    counts = value if isinstance(value, dict) and set(value) == {"compared_tensors", "differing_tensors"} else None
    if counts is None or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts.values()) \
            or counts["differing_tensors"] > counts["compared_tensors"]:
        raise ArtifactInvalidError(f"manifest {UNCHANGED_CHECK} must be {{compared_tensors: n, differing_tensors: m <= n}}")


def _reject_absolute_paths(obj: Any, where: str = "manifest") -> None:
    """No local path of the producing machine may appear anywhere in the manifest."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            _reject_absolute_paths(key, where)
            _reject_absolute_paths(value, f"{where}.{key}")
    elif isinstance(obj, list):
        for value in obj:
            _reject_absolute_paths(value, where)
    elif isinstance(obj, str) and (obj.startswith("/") or obj.startswith("~") or (len(obj) > 2 and obj[1:3] == ":\\")):
        raise ArtifactInvalidError(f"{where} holds an absolute path ({obj[:40]}...)")
