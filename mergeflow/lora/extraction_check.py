"""What `test` checks of an extracted adapter: lora_extraction.json against the adapter file it describes.

The record's `.diff` / `.diff_b` entries (an extraction into a ComfyUI file) must be exactly the
file's, each of its recorded shape, dtype and sha256 (of the tensor's bytes as stored).
The record's kept norms are recomputed from the factors in the file (||scale * up @ down||_F per
module, scale = alpha / rank where an alpha is stored), its ranks from the factors' shapes and its
overall figures from its own layers; the weights file's size from the file. A module the output
renamed or fused (ComfyUI's qkv) is checked through the total: the squared kept norms of the
parts sum to the fused module's (its up is block diagonal).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mergeflow.errors import ArtifactInvalidError
from mergeflow.formats.manifest import ManifestDocument
from mergeflow.io.jsonfiles import read_json_strict
from mergeflow.lora.extract_spec import EXTRACTION_NAME

_PAIRS = (("lora_A.weight", "lora_B.weight"), ("lora_down.weight", "lora_up.weight"))
_DIRECT_PREFIXES = ("base_model.model.", "transformer.")  # PEFT's and Diffusers' keys: prefix + module
_REL = 1e-4  # float32 norms of the same products, summed in another order


def _close(a: float, b: float) -> bool:
    return math.isclose(a, b, rel_tol=_REL, abs_tol=1e-12)


def _kept_norms(path: Path) -> dict[str, tuple[int, float]]:
    """Stem -> (rank, ||scale * up @ down||_F) of every factor pair in the file."""
    import torch
    from safetensors import safe_open

    found: dict[str, tuple[int, float]] = {}
    with safe_open(str(path), framework="pt") as handle:
        keys = set(handle.keys())
        for key in sorted(keys):
            for down_suffix, up_suffix in _PAIRS:
                if not key.endswith("." + down_suffix):
                    continue
                stem = key[: -len(down_suffix) - 1]
                up_key = f"{stem}.{up_suffix}"
                if up_key not in keys:
                    raise ArtifactInvalidError(f"{path.name}: {key} has no {up_suffix}")
                down = handle.get_tensor(key).to(torch.float32)
                up = handle.get_tensor(up_key).to(torch.float32)
                rank = down.shape[0]
                scale = float(handle.get_tensor(f"{stem}.alpha")) / rank if f"{stem}.alpha" in keys else 1.0
                found[stem] = (rank, float(torch.linalg.norm(up @ down)) * scale)
    return found


def _layers(record: Any) -> list[Mapping[str, Any]]:
    layers = record.get("layers") if isinstance(record, dict) else None
    summary = record.get("summary") if isinstance(record, dict) else None
    if not isinstance(layers, list) or not layers or not isinstance(summary, dict):
        raise ArtifactInvalidError(f"{EXTRACTION_NAME} needs a non-empty 'layers' list and a 'summary'")
    for layer in layers:
        if not isinstance(layer, dict) or not isinstance(layer.get("module"), str) or not all(
                isinstance(layer.get(k), (int, float)) and not isinstance(layer.get(k), bool)
                for k in ("rank", "delta_norm", "kept_norm", "retained", "max_abs_error")):
            raise ArtifactInvalidError(f"{EXTRACTION_NAME}: a layer entry lacks its module, rank or figures")
    return layers


def check_extraction(root: Path, manifest: ManifestDocument, weights_name: str) -> None:
    """Refuse an extraction record that the adapter file (or the record itself) contradicts."""
    record = read_json_strict(root / EXTRACTION_NAME, ArtifactInvalidError, EXTRACTION_NAME)
    layers = _layers(record)
    summary = record["summary"]
    size = (root / weights_name).stat().st_size
    if summary.get("adapter_file") != weights_name or summary.get("adapter_file_bytes") != size:
        raise ArtifactInvalidError(f"{EXTRACTION_NAME} records {summary.get('adapter_file_bytes')} bytes of "
                                   f"{summary.get('adapter_file')}, but {weights_name} holds {size}")
    kept = _kept_norms(root / weights_name)
    direct = 0
    for layer in layers:
        module = layer["module"]
        stem = next((p + module for p in _DIRECT_PREFIXES if p + module in kept), None)
        want_retained = layer["kept_norm"] / layer["delta_norm"] if layer["delta_norm"] else 1.0
        if not _close(layer["retained"], want_retained):
            raise ArtifactInvalidError(f"{EXTRACTION_NAME}: {module}'s retained energy is not its kept norm / dW norm")
        if stem is None:
            continue
        direct += 1
        rank, norm = kept[stem]
        if rank != layer["rank"]:
            raise ArtifactInvalidError(f"{EXTRACTION_NAME}: {module} has rank {layer['rank']}, the file's factors {rank}")
        if not _close(norm, layer["kept_norm"]):
            raise ArtifactInvalidError(f"{EXTRACTION_NAME}: {module}'s kept norm {layer['kept_norm']} differs from "
                                       f"||B A|| = {norm} of {weights_name}")
    _check_diffs(root / weights_name, record.get("diffs", []))
    total = math.sqrt(sum(layer["kept_norm"] ** 2 for layer in layers))
    if direct != len(kept) and not _close(total, math.sqrt(sum(n**2 for _, n in kept.values()))):
        raise ArtifactInvalidError(f"{EXTRACTION_NAME}: the kept norm of all layers differs from the factors of {weights_name}")
    weight = sum(layer["delta_norm"] ** 2 for layer in layers)
    mean = sum(layer["retained"] * layer["delta_norm"] ** 2 for layer in layers) / weight if weight else 1.0
    figures = {"layers": len(layers), "energy_weighted_retained": mean,
               "min_retained": min(layer["retained"] for layer in layers),
               "max_abs_error": max(layer["max_abs_error"] for layer in layers)}
    for key, value in figures.items():
        if not isinstance(summary.get(key), (int, float)) or not _close(float(summary[key]), float(value)):
            raise ArtifactInvalidError(f"{EXTRACTION_NAME}: summary {key} {summary.get(key)} is not its layers' {value}")


def _check_diffs(path: Path, diffs: Any) -> None:
    """The file's `.diff` / `.diff_b` keys are the record's entries, each of the recorded shape, dtype and sha256."""
    import hashlib

    from safetensors import safe_open

    from mergeflow.export.reconstruct.rebuild import bits
    from mergeflow.lora.diffs import is_diff_key

    if not isinstance(diffs, list) or not all(isinstance(d, dict) and isinstance(d.get("key"), str) for d in diffs):
        raise ArtifactInvalidError(f"{EXTRACTION_NAME}: 'diffs' must be a list of entries with a key")
    recorded = {d["key"]: d for d in diffs}
    with safe_open(str(path), framework="pt") as handle:
        held = set(filter(is_diff_key, handle.keys()))
        if held != set(recorded):
            extra, missing = sorted(held - set(recorded)), sorted(set(recorded) - held)
            raise ArtifactInvalidError(f"{path.name} and {EXTRACTION_NAME} disagree on the .diff entries "
                                       f"(unrecorded {extra[:3]}, missing {missing[:3]})")
        for key in sorted(held):
            tensor = handle.get_tensor(key)
            entry = recorded[key]
            if list(tensor.shape) != entry.get("shape") or str(tensor.dtype).removeprefix("torch.") != entry.get("dtype"):
                raise ArtifactInvalidError(f"{key} is {tensor.dtype}{list(tensor.shape)} in {path.name} but "
                                           f"{entry.get('dtype')}{entry.get('shape')} in {EXTRACTION_NAME}")
            if hashlib.sha256(bits(tensor.contiguous()).numpy().tobytes()).hexdigest() != entry.get("sha256"):
                raise ArtifactInvalidError(f"{key} in {path.name} does not hash to the sha256 {EXTRACTION_NAME} records")
