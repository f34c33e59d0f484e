"""The safetensors container: dtype names, header layout and strict header parsing."""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from mergeflow.errors import ArtifactInvalidError
from mergeflow.io.jsonfiles import parse_json_strict

if TYPE_CHECKING:  # torch only where tensors are made: `mergeflow test` reads headers without it
    import torch

# torch dtype name <-> safetensors dtype tag, with the element size in bytes.
DTYPES: dict[str, tuple[str, int]] = {
    "float64": ("F64", 8),
    "float32": ("F32", 4),
    "float16": ("F16", 2),
    "bfloat16": ("BF16", 2),
    "float8_e4m3fn": ("F8_E4M3", 1),
    "float8_e5m2": ("F8_E5M2", 1),
    "int64": ("I64", 8),
    "int32": ("I32", 4),
    "int16": ("I16", 2),
    "int8": ("I8", 1),
    "uint8": ("U8", 1),
    "uint16": ("U16", 2),
    "uint32": ("U32", 4),
    "uint64": ("U64", 8),
    "bool": ("BOOL", 1),
}
TAG_TO_NAME = {tag: name for name, (tag, _) in DTYPES.items()}
HEADER_ALIGN = 8
MAX_HEADER = 100 * 1024 * 1024


def torch_dtype(name: str) -> torch.dtype:
    import torch

    return getattr(torch, name)


def nbytes(dtype: str, shape: tuple[int, ...] | list[int]) -> int:
    return DTYPES[dtype][1] * math.prod(shape)


@dataclass(frozen=True)
class HeaderEntry:
    dtype: str  # torch dtype name
    shape: tuple[int, ...]
    begin: int  # offset within the data section
    end: int


# The ModelSpec convention (kohya's sd-scripts, musubi-tuner): "0x" + the sha256 of the tensor data,
# the bytes after the header, so that editing the metadata leaves it unchanged. A writer that finds this
# key in a file's metadata fills it in; until then it holds a placeholder of the same length.
DATA_HASH_KEY = "modelspec.hash_sha256"
DATA_HASH_PLACEHOLDER = "0x" + "0" * 64


def data_hash_value(hexdigest: str) -> str:
    return f"0x{hexdigest}"


def build_header(tensors: list[tuple[str, str, tuple[int, ...]]], metadata: dict[str, str]) -> tuple[bytes, dict[str, HeaderEntry]]:
    """Header bytes (length prefix included) for tensors laid out in the given order."""
    header: dict[str, object] = {"__metadata__": metadata}
    entries: dict[str, HeaderEntry] = {}
    offset = 0
    for name, dtype, shape in tensors:
        size = nbytes(dtype, shape)
        header[name] = {"dtype": DTYPES[dtype][0], "shape": list(shape), "data_offsets": [offset, offset + size]}
        entries[name] = HeaderEntry(dtype, tuple(shape), offset, offset + size)
        offset += size
    text = json.dumps(header, separators=(",", ":")).encode("utf-8")
    # Pad with spaces so the data section starts 8-byte aligned, as the reference writer does.
    text += b" " * ((-len(text)) % HEADER_ALIGN)
    return struct.pack("<Q", len(text)) + text, entries


def _is_count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def read_header(path: Path) -> tuple[dict[str, HeaderEntry], dict[str, str], int]:
    """Parse and check a safetensors header: (entries, metadata, data section start)."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        prefix = handle.read(8)
        if len(prefix) != 8:
            raise ArtifactInvalidError(f"{path.name} is not a safetensors file (shorter than 8 bytes)")
        (length,) = struct.unpack("<Q", prefix)
        if length > MAX_HEADER or 8 + length > size:
            raise ArtifactInvalidError(f"{path.name}: safetensors header length {length} is invalid")
        raw = handle.read(length)
    # Strict: with a tensor named twice, Python keeps the last entry and other readers may keep the first.
    header = parse_json_strict(raw, ArtifactInvalidError, f"{path.name}: safetensors header")
    if not isinstance(header, dict):
        raise ArtifactInvalidError(f"{path.name}: safetensors header is not an object")
    metadata = header.pop("__metadata__", None)
    if metadata is None:
        metadata = {}
    # The format allows only a string-to-string map here; the safetensors library refuses anything
    # else when it loads the file, so a base carrying it would fail after the shards are written.
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise ArtifactInvalidError(f"{path.name}: safetensors header __metadata__ is not a map of strings to strings "
                                   f"(it is a {type(metadata).__name__}{'' if not isinstance(metadata, dict) else ' with other values'})")
    entries: dict[str, HeaderEntry] = {}
    spans = []
    for name, info in header.items():
        try:
            tag, shape, (begin, end) = info["dtype"], tuple(info["shape"]), info["data_offsets"]
            dtype = TAG_TO_NAME[tag]
        except (KeyError, TypeError, ValueError):
            raise ArtifactInvalidError(f"{path.name}: malformed header entry for {name!r}") from None
        # JSON gives any type: a string shape or offsets must be refused here, not fail in arithmetic.
        if not all(_is_count(v) for v in (*shape, begin, end)):
            raise ArtifactInvalidError(f"{path.name}: header entry for {name!r} has a shape or offsets that are not "
                                       "non-negative integers")
        if end - begin != nbytes(dtype, shape) or begin < 0:
            raise ArtifactInvalidError(f"{path.name}: {name} has offsets {begin}..{end} that do not match {tag}{list(shape)}")
        entries[name] = HeaderEntry(dtype, shape, begin, end)
        spans.append((begin, end))
    spans.sort()
    cursor = 0
    for begin, end in spans:
        if begin != cursor:
            raise ArtifactInvalidError(f"{path.name}: tensor data has a gap or overlap at byte {begin}")
        cursor = end
    data_start = 8 + length
    if data_start + cursor != size:
        raise ArtifactInvalidError(f"{path.name}: file is {size} bytes but the header describes {data_start + cursor}")
    return entries, metadata, data_start
