"""What `test` checks in an exported adapter directory (`lora_adapter/`, artifact_type `peft_adapter`).

An adapter directory is an artifact of its own (its manifest lists its files and tensors), so it can
be validated wherever it is copied. When it sits inside a model export, the root manifest also lists
its three files, so the root's file tree stays exact. A LoRA-only adapter export has no root
manifest: its target holds `lora_adapter/` and nothing else.
"""

from __future__ import annotations

from pathlib import Path

from mergeflow.errors import ArtifactInvalidError, LoraError
from mergeflow.formats.manifest import MANIFEST_NAME
from mergeflow.formats.safetensors_format import read_header
from mergeflow.io.jsonfiles import JsonObject, parse_json_strict, read_json_strict
from mergeflow.lora.config import ADAPTER_CONFIG_NAME, settings_from_config_dict
from mergeflow.lora.export import (
    DIFFUSERS_LORA_WEIGHTS_NAME,
    DIFFUSERS_METADATA_KEY,
    PEFT_ADAPTER_WEIGHTS_NAME,
)
from mergeflow.lora.keys import PEFT_PREFIX

ADAPTER_DIR = "lora_adapter"
ADAPTER_MANIFEST = f"{ADAPTER_DIR}/{MANIFEST_NAME}"
_WEIGHTS = {"peft": PEFT_ADAPTER_WEIGHTS_NAME, "diffusers": DIFFUSERS_LORA_WEIGHTS_NAME}


def adapter_only_root(root: Path) -> Path | None:
    """`root/lora_adapter` when root is a LoRA-only adapter export (no root manifest, nothing else)."""
    if (root / MANIFEST_NAME).exists() or (root / MANIFEST_NAME).is_symlink():
        return None
    inner = root / ADAPTER_DIR
    if inner.is_symlink() or not (inner / MANIFEST_NAME).is_file():
        return None
    others = sorted(p.name for p in root.iterdir() if p.name != ADAPTER_DIR)
    if others:
        raise ArtifactInvalidError(f"{others[0]} lies beside {ADAPTER_DIR}/ in an adapter-only export; it is not listed anywhere")
    return inner


def _adapter_record(manifest: JsonObject) -> JsonObject:
    record = manifest.get("lora_adapter")
    if not isinstance(record, dict) or record.get("format") not in _WEIGHTS:
        raise ArtifactInvalidError("a peft_adapter manifest needs lora_adapter.format 'peft' or 'diffusers'")
    return record


def _check_config(root: Path, record: JsonObject) -> None:
    data = read_json_strict(root / ADAPTER_CONFIG_NAME, ArtifactInvalidError, ADAPTER_CONFIG_NAME)
    if not isinstance(data, dict):
        raise ArtifactInvalidError(f"{ADAPTER_CONFIG_NAME} must hold a JSON object")
    try:
        settings = settings_from_config_dict(data, ADAPTER_CONFIG_NAME)
    except LoraError as exc:
        raise ArtifactInvalidError(str(exc)) from None
    if (settings.r, settings.lora_alpha) != (record.get("r"), record.get("lora_alpha")):
        raise ArtifactInvalidError(f"{ADAPTER_CONFIG_NAME} r / lora_alpha disagree with the manifest")
    name = data.get("base_model_name_or_path")
    if isinstance(name, str) and (name.startswith(("/", "~")) or "\\" in name):
        raise ArtifactInvalidError(f"{ADAPTER_CONFIG_NAME} names a local path as base_model_name_or_path")


def _check_metadata(file_name: str, metadata: dict[str, str], adapter_format: str) -> None:
    if metadata.get("format") != "pt":
        raise ArtifactInvalidError(f"{file_name}: header metadata lacks format 'pt'")
    if adapter_format != "diffusers":
        return
    raw = metadata.get(DIFFUSERS_METADATA_KEY)
    packed = parse_json_strict(raw, ArtifactInvalidError, f"{file_name}: header {DIFFUSERS_METADATA_KEY}") if isinstance(raw, str) and raw else None
    if not isinstance(packed, dict) or not packed:
        # Without it Diffusers silently takes lora_alpha = r (SPEC section 4).
        raise ArtifactInvalidError(f"{file_name}: header lacks a valid {DIFFUSERS_METADATA_KEY}")


def check_adapter_weights(root: Path, manifest: JsonObject) -> int:
    """The adapter's config and weight file agree with its manifest; returns the tensor count."""
    record = _adapter_record(manifest)
    adapter_format = record["format"]
    file_name = _WEIGHTS[adapter_format]
    if file_name not in manifest["files"]:
        raise ArtifactInvalidError(f"the adapter manifest does not list {file_name}")
    if adapter_format == "peft":
        _check_config(root, record)
    entries, metadata, _ = read_header(root / file_name)
    _check_metadata(file_name, metadata, adapter_format)
    prefix = PEFT_PREFIX if adapter_format == "peft" else "transformer."
    odd = sorted(key for key in entries if not key.startswith(prefix))
    if odd:
        raise ArtifactInvalidError(f"{file_name} holds {odd[0]}, which does not start with {prefix!r}")
    tensors = manifest["tensors"]
    if set(entries) != set(tensors):
        extra, missing = sorted(set(entries) - set(tensors)), sorted(set(tensors) - set(entries))
        raise ArtifactInvalidError(f"{file_name} and the manifest disagree on the tensor set (extra {extra[:3]}, missing {missing[:3]})")
    for key, entry in entries.items():
        info = tensors[key]
        if info["dtype"] != entry.dtype or list(entry.shape) != info["shape"]:
            raise ArtifactInvalidError(f"{key} is {entry.dtype}{list(entry.shape)} in {file_name} but {info['dtype']}{info['shape']} in the manifest")
    return len(entries)
