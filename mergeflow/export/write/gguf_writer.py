"""The GGUF weights writer: the second `WeightsWriter` (mergeflow/outputs/base.py), for `--output_format gguf`.

One file, written with the `gguf` package's own `GGUFWriter` in its streaming order: every tensor's info
first (names, stored shapes, types, offsets: all known from the plan), then the key-value data, then each
tensor built from its sources, encoded, measured against its source and written, in file order (the next
ones built and encoded on two threads while the writer writes: `encoded_ahead`; memory stays a few of the
largest tensors deep). The file is fsynced, read back with `gguf.GGUFReader` (every tensor's bytes and
dequantized values against the digests taken while writing), hashed, and renamed into place. The encoding
figures (per tensor: type, source sha256, stored and dequantized digests, Q8_0 scales and errors) go into
the file's resume record, from which the output puts them in the manifest's `quantization` record.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, replace
from math import prod
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mergeflow.errors import CheckpointError

if TYPE_CHECKING:
    from collections.abc import Iterator

    import numpy as np
    import torch

    from mergeflow.architectures.gguf_layout import GgufArchitecture, TensorEncoding
    from mergeflow.export.reconstruct.rebuild import PieceSource
    from mergeflow.records import OutputPlan, ShardPlan, ShardRecord, TensorWrite

# The shard metadata keys the output plans (mergeflow/outputs/gguf.py): part of the file's fingerprint.
ARCH_KEY = "general.architecture"
METHOD_KEY = "quantize"
MERGEFLOW_KEY = "mergeflow"  # a string KV in the file: producer, layout, Diffusers class
ORIG_SHAPE_PREFIX = "comfy.gguf.orig_shape."
QUANTIZATION_FIELD = "quantization"  # in the file's resume record (work_dir/shard-NNNNN.json)
BOUND = ("q8_0: |x - q*d_h| <= (d_h + h)/2 + 127*h + 2^-15*(d_h + h) per 32-value block, d_h its float16 scale, "
         "h half a float16 ulp at d_h; bf16: the bf16 cast bit for bit; f32: the source bit for bit")


def stored_nbytes(kind: str, shape: tuple[int, ...]) -> int:
    from mergeflow.formats.gguf_quant import Q8_0_BLOCK, Q8_0_BYTES

    n = prod(shape)
    return {"F32": 4 * n, "BF16": 2 * n}.get(kind, n // Q8_0_BLOCK * Q8_0_BYTES)


def file_encodings(shard: ShardPlan) -> tuple[GgufArchitecture, str, list[tuple[TensorWrite, TensorEncoding]]]:
    """The architecture, the method and every tensor's encoding, in file order (sorted by key)."""
    from mergeflow.architectures.gguf_layout import architecture_named, encoding

    metadata = shard.metadata or {}
    arch = architecture_named(metadata.get(ARCH_KEY, ""))
    method = metadata.get(METHOD_KEY, "")
    if arch is None or method not in ("bf16", "q8_0"):
        raise CheckpointError(f"{shard.file_name}: a GGUF file needs its architecture and method planned (got {metadata})")
    ordered = sorted(shard.tensors, key=lambda t: t.name)
    return arch, method, [(tw, encoding(arch, tw.name, tuple(tw.layout.shape), method)) for tw in ordered]


@dataclass(frozen=True)
class GgufWriter:
    """city96's ComfyUI-GGUF layout, written by `gguf.GGUFWriter` (see the module docstring)."""

    def pack(self, writes: list[TensorWrite], max_shard_size: int, weights_name: str, plan_fingerprint: str) -> OutputPlan:
        from mergeflow.export.write.shard_writer import pack_shards
        from mergeflow.formats.manifest import fingerprint

        packed = pack_shards(writes, sys.maxsize, weights_name, plan_fingerprint)  # one file, whatever --max_shard_size
        return replace(packed, shards=tuple(replace(s, fingerprint=fingerprint([s.fingerprint, "gguf-v1"]))
                                            for s in packed.shards))

    def write_file(self, shard: ShardPlan, states: PieceSource, tensor_dir: Path, work_dir: Path) -> ShardRecord:
        from mergeflow.io.os_errors import name_written_file, typed_os_error

        try:
            return _write_gguf(shard, states, tensor_dir, work_dir)
        except OSError as exc:
            name_written_file(exc, work_dir / f"{shard.file_name}.partial")
            typed = typed_os_error(exc, f"writing {shard.file_name}")
            if typed is None:
                raise
            raise typed from None


GGUF_WRITER = GgufWriter()


def record_path(work_dir: Path, shard: ShardPlan) -> Path:
    return work_dir / f"shard-{shard.index:05d}.json"


def source_tensor(tw: TensorWrite, states: PieceSource) -> torch.Tensor:
    """One original-layout tensor, whole, in its planned dtype: its sources re-verified bit for bit against the ranks."""
    from mergeflow.export.reconstruct.rebuild import cast
    from mergeflow.lora.fusion import read_source, transformed_tensor
    from mergeflow.records import CheckpointSource

    if tw.transform is not None:
        return transformed_tensor(tw, states, verify=True)
    tensor = read_source(CheckpointSource(tw.layout), states, verify=True)
    assert tensor is not None
    return cast(tensor, tw.out_dtype, tw.name).contiguous()  # type: ignore[arg-type]


def tensor_bytes_sha256(tensor: torch.Tensor) -> str:
    import hashlib

    import torch

    return hashlib.sha256(memoryview(tensor.contiguous().reshape(-1).view(torch.uint8).numpy())).hexdigest()


def _encode(tw: TensorWrite, enc: TensorEncoding, tensor: torch.Tensor) -> tuple[np.ndarray, dict[str, Any]]:
    """The stored array of one tensor and its figures, measured against the source (refused if off its bound).

    Q8_0 by gguf-py, BF16 the bf16 cast's own bytes, F32 the float32 values; their dequantized values as
    gguf-py computes them (in torch; the staged check and `test` recompute them with gguf-py, and prove F32
    tensors, and BF16 ones of a bf16 source, equal to the source's sha256)."""
    import torch

    from mergeflow.formats.gguf_quant import q8_0_encode, stored_figures

    if enc.kind == "Q8_0":  # quantized and measured in one pass over runs of blocks, figures as below
        encoded = q8_0_encode(tensor, enc.stored_shape)
        record: dict[str, Any] = {"type": enc.kind, "reason": enc.reason, "source_sha256": encoded.source_sha256,
                                  **encoded.figures.to_json()}
        if enc.stored_shape != tuple(tw.layout.shape):
            record["orig_shape"] = list(tw.layout.shape)
        record.update(encoded.errors)
        if not record["bound_ratio"] <= 1.0:
            raise CheckpointError(f"{tw.name}: Q8_0 error {record['max_abs_error']} exceeds its block-scale bound")
        return encoded.stored, record
    values = tensor.to(torch.float32).reshape(enc.stored_shape)
    if enc.kind == "BF16":
        cast = tensor.to(torch.bfloat16).reshape(enc.stored_shape).contiguous()
        stored, dequantized = cast.view(torch.uint8), cast.to(torch.float32)
    else:
        stored = dequantized = values.contiguous()
    record = {"type": enc.kind, "reason": enc.reason, "source_sha256": tensor_bytes_sha256(tensor),
              **stored_figures(stored.numpy(), enc.kind, dequantized.numpy()).to_json()}
    if enc.stored_shape != tuple(tw.layout.shape):
        record["orig_shape"] = list(tw.layout.shape)
    return stored.numpy(), record


# Threads building and encoding tensors ahead of the writer (one per core here), and the window in largest tensors.
ENCODE_AHEAD = 2


def encoded_ahead(encodings: list[tuple[TensorWrite, TensorEncoding]],
                  states: PieceSource) -> Iterator[tuple[np.ndarray, dict[str, Any]]]:
    """Each tensor's stored array and record (`_encode` of `source_tensor`), in file order, built and encoded
    on ENCODE_AHEAD threads while the writer writes the ones before.

    A tensor's build (rank pieces copied out of their mappings, verified, cast) and its Q8_0 encoding
    (torch's kernels and hashlib's digests) release the GIL for most of their time, and the writer mostly
    waits on the disk: one after the other on the writer's thread they were the export's critical path
    (py-spy at real depth: the writer's thread busy ~47 s of a ~57 s export). The window is counted in
    values, ENCODE_AHEAD times the largest tensor's: a file alternates each weight with its small bias, and
    a window of two tensors held one weight and one bias, leaving a thread idle half the export (py-spy:
    each encoding thread waited ~15 s of ~30 s for work while the writer waited on them). Memory: at most
    ENCODE_AHEAD + 1 of the largest tensors (each its source and its stored bytes) beyond the one being
    written, whatever the model's depth. An error is raised where its tensor would have been written, after
    the tensors before it.
    """
    from mergeflow.parallel import ordered_map, worker_count

    def encode(pair: tuple[TensorWrite, TensorEncoding]) -> tuple[np.ndarray, dict[str, Any]]:
        tw, enc = pair
        return _encode(tw, enc, source_tensor(tw, states))

    def values(pair: tuple[TensorWrite, TensorEncoding]) -> int:
        return max(1, prod(pair[0].layout.shape))

    largest = max(map(values, encodings), default=1)
    return ordered_map(encode, encodings, workers=min(ENCODE_AHEAD, worker_count()), cost=values,
                       budget=ENCODE_AHEAD * largest)


def _write_gguf(shard: ShardPlan, states: PieceSource, tensor_dir: Path, work_dir: Path) -> ShardRecord:
    from concurrent.futures import ThreadPoolExecutor
    from contextlib import closing

    import gguf
    import numpy as np

    from mergeflow.io.fs import FileStamp, fsync_dir
    from mergeflow.io.interrupt import raise_if_stopped
    from mergeflow.io.jsonfiles import write_json_durable
    from mergeflow.io.ranges import file_digests
    from mergeflow.io.session import active_session, sha256_file
    from mergeflow.io.staging import file_stamp
    from mergeflow.records import ShardRecord

    arch, method, encodings = file_encodings(shard)
    final = tensor_dir / shard.file_name
    reused = _reusable(record_path(work_dir, shard), final, shard)
    if reused is not None:
        return reused
    partial = work_dir / f"{shard.file_name}.partial"
    writer = gguf.GGUFWriter(path=None, arch=arch.name)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if method == "q8_0" else gguf.LlamaFileType.MOSTLY_BF16)
    writer.add_string(MERGEFLOW_KEY, (shard.metadata or {}).get(MERGEFLOW_KEY, "{}"))
    for tw, enc in encodings:
        if enc.stored_shape != tuple(tw.layout.shape):
            writer.add_array(f"{ORIG_SHAPE_PREFIX}{tw.name}", [int(d) for d in tw.layout.shape])
        writer.add_tensor_info(tw.name, enc.stored_shape, np.dtype(np.float32), stored_nbytes(enc.kind, enc.stored_shape),
                               raw_dtype=gguf.GGMLQuantizationType[enc.kind])
    records: dict[str, dict[str, Any]] = {}
    session = active_session()
    try:
        writer.write_header_to_file(path=partial)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        with closing(encoded_ahead(encodings, states)) as encoded:
            for (tw, _), (stored, records[tw.name]) in zip(encodings, encoded, strict=True):
                raise_if_stopped()  # Ctrl-C / SIGTERM: stop between tensors
                writer.write_tensor_data(stored)
                if session is not None:
                    session.writes.report(int(stored.nbytes), 1)
                del stored
        assert writer.fout is not None
        writer.fout[0].flush()
        os.fsync(writer.fout[0].fileno())
    finally:
        writer.close()
    # The file's sha256 and its ranges, from the page cache on other threads while the read-back hashes
    # each tensor.
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256-file") as pool:
        digests = pool.submit(file_digests, partial, sha256_file)
        verify_gguf(partial, arch.name, encodings, records)
        digest, ranges = digests.result()
    os.replace(partial, final)
    fsync_dir(final.parent)
    record = ShardRecord(file_name=shard.file_name, sha256=digest, size=final.stat().st_size,
                         tensors={tw.name: (tw.out_dtype, tuple(tw.layout.shape)) for tw, _ in encodings},
                         plan_fingerprint=shard.fingerprint, verified_stamp=FileStamp.of(final), ranges=ranges)
    quantization = {"method": method, "format": "gguf", "architecture": arch.name, "bound": BOUND,
                    "kept_f32": sorted(k for k, r in records.items() if r["type"] == "F32"),
                    "excluded": sorted(k for k, r in records.items() if method == "q8_0" and r["type"] == "BF16"),
                    "tensors": records}
    write_json_durable(record_path(work_dir, shard),
                       {**asdict(record), "stamp": file_stamp(final), QUANTIZATION_FIELD: quantization})
    return record


def verify_gguf(path: Path, arch: str, encodings: list[tuple[TensorWrite, TensorEncoding]],
                records: dict[str, dict[str, Any]]) -> None:
    """The written file, read back by `gguf.GGUFReader`: the architecture, every tensor's name, type, shape and
    bytes (the digest taken while encoding); the staged check (`test`'s) then dequantizes it with gguf-py."""
    import gguf

    from mergeflow.formats.gguf_quant import sha256_array

    reader = gguf.GGUFReader(path)
    if read_string(reader, ARCH_KEY) != arch:
        raise CheckpointError(f"{path.name}: general.architecture does not read back as {arch!r}")
    tensors = {t.name: t for t in reader.tensors}
    if list(tensors) != [tw.name for tw, _ in encodings]:
        raise CheckpointError(f"{path.name}: the tensors read back are not the ones written, in order")
    for tw, enc in encodings:
        t = tensors[tw.name]
        if t.tensor_type.name != enc.kind or tuple(int(d) for d in reversed(t.shape.tolist())) != enc.stored_shape:
            raise CheckpointError(f"{path.name}: {tw.name} reads back as {t.tensor_type.name} {list(t.shape)}")
        # The bytes measured while encoding: their dequantized values, errors and digests are the file's.
        if sha256_array(t.data) != records[tw.name]["stored_sha256"]:
            raise CheckpointError(f"{path.name}: {tw.name}'s bytes differ from those written")
        if enc.stored_shape != tuple(tw.layout.shape) and read_ints(reader, f"{ORIG_SHAPE_PREFIX}{tw.name}") != list(tw.layout.shape):
            raise CheckpointError(f"{path.name}: {tw.name}'s original shape does not read back")


def read_string(reader: Any, key: str) -> str | None:
    """A string KV as ComfyUI-GGUF's loader reads it (`get_field(..., str)`)."""
    field = reader.get_field(key)
    if field is None or len(field.types) != 1 or field.types[0].name != "STRING":
        return None
    return str(bytes(field.parts[field.data[-1]]), encoding="utf-8")


def read_ints(reader: Any, key: str) -> list[int] | None:
    """An INT32 array KV (`comfy.gguf.orig_shape.*`) as ComfyUI-GGUF's `get_orig_shape` reads it."""
    field = reader.get_field(key)
    if field is None or [t.name for t in field.types] != ["ARRAY", "INT32"]:
        return None
    return [int(field.parts[i][0]) for i in field.data]


def _reusable(path: Path, final: Path, shard: ShardPlan) -> ShardRecord | None:
    """A file from an earlier attempt counts only if its record (quantization record included) matches
    and its bytes hash the same."""
    from mergeflow.export.write.shard_writer import reusable_record

    return reusable_record(path, final, shard, needs=QUANTIZATION_FIELD)


def recorded_quantization(work_dir: Path, index: int = 0) -> dict[str, Any] | None:
    """The `quantization` record the writer kept beside the file (None when there is none)."""
    path = work_dir / f"shard-{index:05d}.json"
    if not path.is_file():
        return None
    value = json.loads(path.read_text()).get(QUANTIZATION_FIELD)
    return value if isinstance(value, dict) else None
