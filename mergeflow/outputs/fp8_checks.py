"""An fp8 single file's manifest record, and what `test` proves of it without the source.

The record (`quantization` in the manifest): the method, the architecture's rule, the tensors kept
unquantized (`excluded`), and per quantized tensor its scale, amax, max absolute and relative
dequantization error and the sha256 of the unquantized original-layout tensor (bf16 bytes), as
measured when the written file was read back (mergeflow/export/write/quantized.py).

`test` checks: the file's scale tensors equal the recorded scales; every recorded error is within
the fp8 bound for its scale; the quantized set is what the architecture's rule gives for the
recorded key map; the header's `_quantization_metadata` is exactly ComfyUI's for that set; dtypes
are float8 / float32 scalar / bf16. A flipped byte anywhere is caught by the manifest's sha256.
No torch: the scales are read from the file's bytes.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mergeflow.architectures.quantization import (
    FP8,
    FP8_DTYPE,
    METADATA_KEY,
    METHOD,
    QUANTIZE_PARAM,
    check_record,
    comfy_metadata,
    quantized_keys,
    scale_key,
)
from mergeflow.errors import ArtifactInvalidError, CheckpointError
from mergeflow.formats.manifest import ManifestDocument
from mergeflow.formats.safetensors_format import read_header

if TYPE_CHECKING:
    from mergeflow.records import MergePlan


def _rule_keys(layout_name: str, shapes: Mapping[str, tuple[int, ...]]) -> tuple[list[str], dict[str, str]]:
    from mergeflow.architectures.original_layout import fp8_rule, layout_named

    rule = fp8_rule(layout_named(layout_name))
    return quantized_keys(rule, shapes), rule.describe()


def quantization_record(plan: MergePlan) -> dict[str, Any] | None:
    """The manifest's record from the kept measurements (None: the file is not quantized)."""
    from mergeflow.architectures.original_layout import LAYOUT_PARAM
    from mergeflow.export.write.quantized import read_stats

    params = plan.conversion.adapter_params
    if params.get(QUANTIZE_PARAM) != FP8:
        return None
    shapes = {k: tuple(v) for k, v in (plan.conversion.output_shapes or {}).items()}
    keys, rule = _rule_keys(str(params[LAYOUT_PARAM]), shapes)
    scales = {scale_key(k) for k in keys}
    measured: dict[str, Any] = {}
    for path in sorted(Path(plan.output.work_dir).glob("quantization-*.json")):
        measured.update(read_stats(path) or {})
    if sorted(measured) != keys:
        raise CheckpointError(f"the quantization records kept while writing cover {len(measured)} tensors, "
                              f"not the {len(keys)} quantized ones")
    return {
        "method": METHOD,
        "format": FP8_DTYPE,
        "rule": rule,
        "excluded": sorted(k for k in shapes if k not in scales and k not in set(keys)),
        "tensors": {k: measured[k] for k in keys},
    }


def _scales_in_file(path: Path, keys: list[str]) -> dict[str, float]:
    """The float32 scalars of the file, read from its bytes (no torch)."""
    entries, _, data_start = read_header(path)
    out: dict[str, float] = {}
    with open(path, "rb") as handle:
        for key in keys:
            handle.seek(data_start + entries[key].begin)
            raw = handle.read(4)
            if len(raw) != 4 or entries[key].end - entries[key].begin != 4:
                raise ArtifactInvalidError(f"{path.name}: {key} is no float32 scalar")
            out[key] = struct.unpack("<f", raw)[0]
    return out


def check_quantization(path: Path, layout_record: Mapping[str, Any], manifest: ManifestDocument) -> None:
    """An fp8 file is what its record says, within the bound; an unquantized one carries no record or marker."""
    params = dict(layout_record.get("params") or {})
    record = manifest.get("quantization")
    _, metadata, _ = read_header(path)
    if params.get(QUANTIZE_PARAM) != FP8:
        if record is not None or METADATA_KEY in metadata:
            raise ArtifactInvalidError(f"{path.name}: quantization recorded, but the key map's params say unquantized")
        return
    if not isinstance(record, dict) or record.get("method") != METHOD or not isinstance(record.get("tensors"), dict):
        raise ArtifactInvalidError(f"{path.name}: an fp8 single file needs its quantization record ({METHOD})")
    tensors = manifest["tensors"]
    scale_keys = {k for k in tensors if k.endswith(".weight_scale")}
    shapes = {k: tuple(v["shape"]) for k, v in tensors.items() if k not in scale_keys}
    try:
        keys, _ = _rule_keys(str(layout_record.get("layout")), shapes)
    except Exception as err:  # an unknown layout or one with no rule: the record does not fit  # noqa: BLE001
        raise ArtifactInvalidError(f"{path.name}: {err}") from None
    if sorted(record["tensors"]) != keys or {scale_key(k) for k in keys} != scale_keys:
        raise ArtifactInvalidError(f"{path.name}: the quantized tensors are not what the architecture's rule gives")
    if sorted(record.get("excluded") or []) != sorted(set(shapes) - set(keys)):
        raise ArtifactInvalidError(f"{path.name}: the recorded excluded list is not the unquantized tensors")
    if metadata.get(METADATA_KEY) != comfy_metadata(keys):
        raise ArtifactInvalidError(f"{path.name}: the header's {METADATA_KEY} does not name exactly the quantized layers")
    for key, info in tensors.items():
        want = ("float32", []) if key in scale_keys else (FP8_DTYPE, info["shape"]) if key in keys else ("bfloat16", info["shape"])
        if (info["dtype"], list(info["shape"])) != (want[0], list(want[1])):
            raise ArtifactInvalidError(f"{path.name}: {key} is {info['dtype']} {info['shape']}, expected {want[0]} {want[1]}")
    scales = _scales_in_file(path, [scale_key(k) for k in keys])
    for key in keys:
        problem = check_record(key, record["tensors"][key], scales[scale_key(key)])
        if problem is not None:
            raise ArtifactInvalidError(f"{path.name}: {problem}")
