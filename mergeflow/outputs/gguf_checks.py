"""What `test` proves of a GGUF artifact without its source (mergeflow/outputs/gguf.py).

The file's sha256 (the manifest's `files`) already proves its bytes; these checks prove the manifest's
`quantization` record is what the file says: `gguf.GGUFReader` opens it; its architecture, tensor set,
types and shapes are the record's and the architecture's rules'; every tensor dequantizes (with
`gguf.quants.dequantize`, as ComfyUI-GGUF does) to the recorded digest; Q8_0 scales give the recorded
block stats and the recorded errors lie within the bound those scales allow; F32 tensors widen the
source's bytes exactly and BF16 tensors of a bf16 source are its bytes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from mergeflow.errors import ArtifactInvalidError
from mergeflow.formats.manifest import ManifestDocument

_FIGURES = ("stored_sha256", "dequantized_sha256", "blocks", "scale_min", "scale_max", "max_bound")


def _number(entry: Mapping[str, Any], key: str, where: str) -> float:
    value = entry.get(key)
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ArtifactInvalidError(f"{where}: quantization record lacks a finite {key}")
    return float(value)


def check_gguf_file(path: Path, manifest: ManifestDocument, quantization: Mapping[str, Any]) -> int:
    import gguf
    import torch

    from mergeflow.architectures.gguf_layout import architecture_named, encoding
    from mergeflow.export.write.gguf_writer import (
        ARCH_KEY,
        ORIG_SHAPE_PREFIX,
        read_ints,
        read_string,
    )
    from mergeflow.formats.gguf_quant import scan_stored

    method, records = quantization.get("method"), quantization.get("tensors")
    arch = architecture_named(str(quantization.get("architecture")))
    if arch is None or method not in ("bf16", "q8_0") or not isinstance(records, dict):
        raise ArtifactInvalidError("the manifest's quantization record names no GGUF architecture, method or tensors")
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, OSError, IndexError) as err:
        raise ArtifactInvalidError(f"{path.name} does not open as GGUF ({err})") from None
    if read_string(reader, ARCH_KEY) != arch.name:
        raise ArtifactInvalidError(f"{path.name}: general.architecture is not {arch.name!r}")
    tensors = {t.name: t for t in reader.tensors}
    if set(tensors) != set(manifest["tensors"]) or set(records) != set(tensors):
        raise ArtifactInvalidError(f"{path.name}: its tensors, the manifest's and the quantization record's differ")
    kept = sorted(k for k, r in records.items() if r.get("type") == "F32")
    excluded = sorted(k for k, r in records.items() if method == "q8_0" and r.get("type") == "BF16")
    if quantization.get("kept_f32") != kept or quantization.get("excluded") != excluded:
        raise ArtifactInvalidError("the quantization record's kept_f32/excluded lists disagree with its tensors")
    for name, t in tensors.items():
        info, entry = manifest["tensors"][name], records[name]
        shape = tuple(info["shape"])
        enc = encoding(arch, name, shape, method)
        stored_shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        if t.tensor_type.name != enc.kind or entry.get("type") != enc.kind or stored_shape != enc.stored_shape:
            raise ArtifactInvalidError(f"{name}: stored as {t.tensor_type.name}{list(stored_shape)}, "
                                       f"the rules say {enc.kind}{list(enc.stored_shape)}")
        if stored_shape != shape and read_ints(reader, f"{ORIG_SHAPE_PREFIX}{name}") != list(shape):
            raise ArtifactInvalidError(f"{name}: reshaped without its comfy.gguf.orig_shape")
        # Source-free bit-exactness where the stored type holds every source value: the digest of the source's bytes.
        source_dtype = getattr(torch, info["dtype"], None)
        exact = (enc.kind != "Q8_0" and (enc.kind == "F32" or source_dtype == torch.bfloat16)
                 and source_dtype in (torch.float32, torch.bfloat16, torch.float16))
        found_figures, back = scan_stored(t.data, enc.kind, source_dtype if exact else None)
        found = found_figures.to_json()
        if any(entry.get(k) != found.get(k) for k in _FIGURES):
            raise ArtifactInvalidError(f"{name}: the file does not reproduce the recorded figures")
        if enc.kind == "Q8_0":
            where = f"quantization.tensors[{name!r}]"
            if _number(entry, "bound_ratio", where) > 1.0 or _number(entry, "max_abs_error", where) > found["max_bound"]:
                raise ArtifactInvalidError(f"{name}: the recorded Q8_0 error exceeds the block-scale bound")
            _number(entry, "max_rel_error", where)
            continue
        if exact and back != entry.get("source_sha256"):
            raise ArtifactInvalidError(f"{name}: the {enc.kind} tensor is not its source bit for bit")
    return len(tensors)
