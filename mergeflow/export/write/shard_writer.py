"""Writing safetensors shards: header first, bytes streamed from the mmapped rank files, hashed inline, read back."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import warnings
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path

import torch

from mergeflow.architectures.registry import adapter_for_op
from mergeflow.errors import CheckpointError
from mergeflow.export.reconstruct.rebuild import (
    PieceSource,
    global_pieces,
    in_rank_order,
    is_cast_in_rank_order,
    is_streamed,
    primary_chunks,
    verified_chunks,
    verify_round_trip,
)
from mergeflow.export.write.quantized import (
    WeightsAhead,
    is_quantized_scale,
    is_quantized_weight,
    quantized_scale,
    quantized_weight,
)
from mergeflow.export.write.readback import FollowingReadBack, read_exact
from mergeflow.formats.manifest import fingerprint, plain
from mergeflow.formats.safetensors_format import (
    DATA_HASH_KEY,
    DTYPES,
    HeaderEntry,
    build_header,
    data_hash_value,
    nbytes,
    read_header,
    torch_dtype,
)
from mergeflow.io.config_paths import strip_local_paths
from mergeflow.io.fs import FileStamp
from mergeflow.io.interrupt import raise_if_stopped
from mergeflow.io.jsonfiles import write_bytes_durable, write_json_durable
from mergeflow.io.os_errors import name_written_file, typed_os_error
from mergeflow.io.ranges import FileRanges, RangeHasher, file_digests, large_share, wants_ranges
from mergeflow.io.session import active_session, current_session, sha256_file
from mergeflow.io.staging import file_stamp
from mergeflow.io.streamio import BackgroundFlush, HashingWriter, TrailingHasher
from mergeflow.lora.fusion import transformed_tensor, verify_transformed
from mergeflow.records import (
    ArchitectureOp,
    CheckpointSource,
    OutputPlan,
    ShardPlan,
    ShardRecord,
    TensorWrite,
)

WRITE_BLOCK = 16 * 1024 * 1024
HEADER_METADATA = {"format": "pt"}

def shard_file_name(weights_name: str, index: int, count: int) -> str:
    if count == 1:
        return weights_name
    stem = weights_name.removesuffix(".safetensors")
    return f"{stem}-{index + 1:05d}-of-{count:05d}.safetensors"


def pack_shards(writes: list[TensorWrite], max_shard_size: int, weights_name: str, plan_fingerprint: str) -> OutputPlan:
    """Greedy packing in sorted name order; a tensor above the budget gets a shard of its own."""
    groups: list[list[TensorWrite]] = []
    current: list[TensorWrite] = []
    size = 0
    for tw in sorted(writes, key=lambda w: w.name):
        n = nbytes(tw.out_dtype, tw.layout.shape)
        if current and size + n > max_shard_size:
            groups.append(current)
            current, size = [], 0
        current.append(tw)
        size += n
    if current or not groups:
        groups.append(current)
    sizes = [sum(nbytes(t.out_dtype, t.layout.shape) for t in group) for group in groups]
    total = sum(sizes)
    shards = []
    for i, (group, size) in enumerate(zip(groups, sizes, strict=True)):
        name = shard_file_name(weights_name, i, len(groups))
        body = [(plain(tw), i) for tw in group]
        ranges = large_share(size, total)
        shards.append(
            ShardPlan(
                index=i,
                file_name=name,
                tensors=tuple(group),
                nbytes=size,
                # The ranges choice is part of what a staged file's record promises (a reused file must carry
                # the ranges the manifest will list, or none).
                fingerprint=fingerprint([plan_fingerprint, name, body, "write-v3", ranges]),
                ranges=ranges,
            )
        )
    return OutputPlan(shards=tuple(shards), total_size=total, tensor_count=len(writes), indexed=len(groups) > 1)


def file_order(tensors: tuple[TensorWrite, ...]) -> list[TensorWrite]:
    """Data order inside a file: widest elements first so every tensor stays aligned."""
    return sorted(tensors, key=lambda t: (-DTYPES[t.out_dtype][1], t.name))


def _as_bytes(tensor: torch.Tensor) -> memoryview:
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def write_shard_file(shard: ShardPlan, states: PieceSource, artifact_dir: Path, work_dir: Path) -> ShardRecord:
    """Write one shard (or reuse a verified one from an earlier attempt) and round-trip verify it."""
    try:
        return _write_shard_file(shard, states, artifact_dir, work_dir)
    except OSError as exc:
        name_written_file(exc, work_dir / f"{shard.file_name}.partial")  # os.write / fsync name no file
        typed = typed_os_error(exc, f"writing {shard.file_name}")
        if typed is None:
            raise
        raise typed from None


def _write_shard_file(shard: ShardPlan, states: PieceSource, artifact_dir: Path, work_dir: Path) -> ShardRecord:
    record_path = work_dir / f"shard-{shard.index:05d}.json"
    final = artifact_dir / shard.file_name
    reused = reusable_record(record_path, final, shard)
    if reused is not None:
        return reused
    ordered = file_order(shard.tensors)
    layout = [(t.name, t.out_dtype, t.layout.shape) for t in ordered]
    metadata = shard.metadata or HEADER_METADATA
    # A file whose header names its data's hash (ModelSpec's modelspec.hash_sha256) is written data
    # first under a placeholder of the same length, the final header going in once the data are hashed:
    # ahead of the writer from the sources when every tensor is its sources' bytes, else while writing.
    hash_in_header = DATA_HASH_KEY in metadata
    header, entries = build_header(layout, metadata)
    partial = partial_path(work_dir, shard)
    if hash_in_header and _hashable_ahead(ordered, entries, shard.nbytes):
        header, digest, data_digest, ranges = _write_hashed_ahead(partial, header, entries, ordered, states, layout,
                                                                  metadata, shard)
    else:
        header, digest, data_digest, ranges = _write_and_hash(partial, header, entries, ordered, states, layout,
                                                              metadata, shard, hash_in_header)
    os.replace(partial, final)
    size = final.stat().st_size
    if ranges is not None and ranges.size != size:
        raise CheckpointError(f"{shard.file_name}: its ranges were hashed over {ranges.size} bytes, the file has {size}")
    record = ShardRecord(
        file_name=shard.file_name,
        sha256=digest,
        size=size,
        tensors={t.name: (t.out_dtype, t.layout.shape) for t in ordered},
        plan_fingerprint=shard.fingerprint,
        verified_stamp=FileStamp.of(final),
        data_sha256=data_digest,
        ranges=ranges,
    )
    # The stamp lets a rerun's cache key tell an intact staged file from a changed one.
    write_json_durable(record_path, {**asdict(record), "stamp": file_stamp(final)})
    return record


def partial_path(work_dir: Path, shard: ShardPlan) -> Path:
    return work_dir / f"{shard.file_name}.partial"


Layout = list[tuple[str, str, tuple[int, ...]]]


def _write_and_hash(partial: Path, header: bytes, entries: dict[str, HeaderEntry], ordered: list[TensorWrite],
                    states: PieceSource, layout: Layout, metadata: dict[str, str], shard: ShardPlan,
                    hash_in_header: bool) -> tuple[bytes, str, str | None, FileRanges | None]:
    """Write the file, hashing its bytes as they are written; returns (header, file sha256, data sha256, ranges).

    A header that names its data's hash (and whose tensors cannot be hashed ahead from the
    sources: computed ones) is written under a same-length placeholder, filled in once the data
    are hashed; the file's own sha256 (and its ranges) is then taken from the page cache in a second pass.
    """
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    flush = BackgroundFlush(fd)
    data_digest: str | None = None
    file_ranges: FileRanges | None = None
    # The writer's blocks are the file's from its first byte only when the header is hashed with them.
    ranges = RangeHasher() if not hash_in_header and shard.ranges and wants_ranges(len(header) + shard.nbytes) else None
    try:
        follow = FollowingReadBack(partial, len(header), entries, states)
        try:
            streamed = _stream_shard(fd, header, entries, ordered, states, follow, flush, not hash_in_header,
                                     ranges=ranges)
        except BaseException:
            follow.abort()
            raise
        assert streamed is not None  # a hashing writer's digest
        digest = streamed
        file_hash: Future[tuple[str, FileRanges | None]] | None = None
        if hash_in_header:
            data_digest = data_hash_value(digest)
            metadata = {**metadata, DATA_HASH_KEY: data_digest}
            header = _rewrite_header(fd, header, layout, metadata)
        flush.fsync()  # the disk flush overlaps the checks that are left, which only need the page cache
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256-file") as pool:
            if hash_in_header:  # hashed from the page cache while the checks below run on the other core
                file_hash = pool.submit(file_digests, partial, sha256_file, shard.ranges)
            follow.finish()
            verify_written_shard(partial, shard, states, header, metadata)
            if file_hash is not None:
                digest, file_ranges = file_hash.result()
        if ranges is not None:  # its thread hashed while the checks above ran
            file_ranges = ranges.finish()
        flush.check()
    except BaseException:
        flush.abandon()
        raise
    finally:
        if ranges is not None:
            ranges.close()
        flush.join()
        os.close(fd)
    return header, digest, data_digest, file_ranges


def _write_hashed_ahead(partial: Path, header: bytes, entries: dict[str, HeaderEntry], ordered: list[TensorWrite],
                        states: PieceSource, layout: Layout, metadata: dict[str, str],
                        shard: ShardPlan) -> tuple[bytes, str, str, FileRanges | None]:
    """Write a file whose header names its data's hash, with no pass over the file after writing it.

    Every tensor here is its sources' bytes (streamed, cast, or fused row blocks) or one of a few small
    computed ones, so the data section's sha256 is taken from the sources on the other core, ahead of
    the disk-bound writer, which writes under a same-length placeholder header; a trailing thread hashes
    the final header, then the data from the page cache just behind the writer. The read-back compares every
    written tensor with those same sources, which is what makes the hash taken from them the data's.
    """
    cancel = threading.Event()
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    flush = BackgroundFlush(fd)
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="sha256-data") as pool:
        data_hash = pool.submit(data_section_sha256, ordered, entries, states, cancel)

        def final_header() -> bytes:
            value = {**metadata, DATA_HASH_KEY: data_hash_value(data_hash.result())}
            return build_header(layout, value)[0]

        ranges = RangeHasher(inline=True) if shard.ranges and wants_ranges(len(header) + shard.nbytes) else None
        trailing = TrailingHasher(partial, len(header), final_header, ranges)
        try:
            follow = FollowingReadBack(partial, len(header), entries, states)
            try:
                _stream_shard(fd, header, entries, ordered, states, follow, flush, False, hashing=False,
                              follower=trailing)
            except BaseException:
                follow.abort()
                raise
            data_digest = data_hash_value(data_hash.result())
            metadata = {**metadata, DATA_HASH_KEY: data_digest}
            header = _rewrite_header(fd, header, layout, metadata)
            flush.fsync()  # the disk flush overlaps the checks that are left, which only need the page cache
            follow.finish()
            verify_written_shard(partial, shard, states, header, metadata)
            digest = trailing.finish(len(header) + shard.nbytes)
            if trailing.header != header:
                raise CheckpointError(f"{shard.file_name}: the header hashed differs from the header written")
            file_ranges = ranges.finish() if ranges is not None else None
            flush.check()
        except BaseException:
            cancel.set()
            trailing.abort()
            flush.abandon()
            raise
        finally:
            if ranges is not None:
                ranges.close()
            flush.join()
            os.close(fd)
    return header, digest, data_digest, file_ranges


# A computed tensor is computed twice when the data are hashed ahead (once for the hash, once to write
# it): worth it for a few small ones (Flux's swapped final modulation), not for a file of them (fp8's
# quantized weights, fused LoRA weights), which is hashed while writing instead.
AHEAD_COMPUTED_SHARE = 1 / 16


def _hashable_ahead(ordered: list[TensorWrite], entries: dict[str, HeaderEntry], total: int) -> bool:
    computed = sum(entries[t.name].end - entries[t.name].begin for t in ordered if not read_back_while_writing(t))
    return computed <= total * AHEAD_COMPUTED_SHARE


def data_section_sha256(ordered: list[TensorWrite], entries: dict[str, HeaderEntry], states: PieceSource,
                        cancel: threading.Event) -> str:
    """The sha256 of a file's data section, from the sources the writer streams its tensors from.

    The same pieces in the same order as `_write_tensor` writes them (each tensor's byte count checked
    against its header entry), a computed tensor computed as the writer computes it; the writer's
    read-back (and the recomputation of computed tensors) then proves the file holds exactly these bytes.
    """
    digest = hashlib.sha256()
    for tw in ordered:
        size = 0
        for part in streamed_parts(tw) or [tw]:
            pieces: Iterable[torch.Tensor] = (
                [transformed_tensor(part, states)] if part.transform is not None
                else global_pieces(part.layout, primary_chunks(part.layout, states,
                                                              in_place=is_streamed(part.layout, part.out_dtype)),
                                   part.out_dtype, part.name))
            for piece in pieces:
                if cancel.is_set():
                    raise CheckpointError("hashing ahead was stopped: the write failed")
                view = _as_bytes(piece)
                digest.update(view)
                size += len(view)
        if size != entries[tw.name].end - entries[tw.name].begin:
            raise CheckpointError(f"{tw.name}: hashed {size} bytes ahead of writing, expected "
                                  f"{entries[tw.name].end - entries[tw.name].begin}")
    return digest.hexdigest()


def _rewrite_header(fd: int, placeholder: bytes, layout: list[tuple[str, str, tuple[int, ...]]],
                    metadata: dict[str, str]) -> bytes:
    """Write the final header over the placeholder (same length, so every data offset stands)."""
    header, _ = build_header(layout, metadata)
    if len(header) != len(placeholder):
        raise CheckpointError(f"the final header is {len(header)} bytes, its placeholder {len(placeholder)}")
    view = memoryview(header)
    while len(view):
        view = view[os.pwrite(fd, view, len(header) - len(view)) :]
    return header


def _stream_shard(fd: int, header: bytes, entries: dict[str, HeaderEntry], ordered: list[TensorWrite], states: PieceSource,
                  follow: FollowingReadBack, flush: BackgroundFlush, hash_header: bool = True, *, hashing: bool = True,
                  follower: TrailingHasher | None = None, ranges: RangeHasher | None = None) -> str | None:
    """Write the header and every tensor's bytes in file order; returns the sha256 of the stream
    (without the header when `hash_header` is False: the data section's).

    Each streamed tensor is handed to `follow` once written, to be read back and compared.
    """
    session = active_session()  # its listeners hear of each tensor written (the flow's progress)
    if not hash_header:
        view = memoryview(header)
        while len(view):
            view = view[os.write(fd, view) :]
    writer = HashingWriter(fd, flush=flush, start=0 if hash_header else len(header), hashing=hashing, follower=follower,
                           ranges=ranges)
    ahead = WeightsAhead(ordered, states, quantized_weight)
    try:
        if hash_header:
            writer.write(memoryview(header))
        for tw in ordered:
            raise_if_stopped()  # Ctrl-C / SIGTERM: stop between tensors, keep the finished shards
            begin = entries[tw.name].begin
            written = 0
            # A fused tensor whose bytes are its sources' one after another is written (and read back)
            # source by source, like plain tensors at their offsets: never built whole in memory.
            for part in streamed_parts(tw) or [tw]:
                written += _write_tensor(writer, part, states, follow, begin + written, ahead)
            if written != entries[tw.name].end - begin:
                raise CheckpointError(f"{tw.name}: wrote {written} bytes, expected {entries[tw.name].end - begin}")
            if session is not None:
                session.writes.report(written, 1)
        return writer.hexdigest() if hashing else None
    finally:
        ahead.close()
        writer.close()


def _write_tensor(writer: HashingWriter, tw: TensorWrite, states: PieceSource, follow: FollowingReadBack,
                  begin: int, ahead: WeightsAhead) -> int:
    """Write one tensor's bytes (at `begin` of the data section) and queue its read-back; returns the bytes written."""
    # A transform (LoRA fusion) computes the tensor from its sources; otherwise stream the rank pieces.
    streamed = tw.transform is None and is_streamed(tw.layout, tw.out_dtype)
    cast_pieces = tw.transform is None and is_cast_in_rank_order(tw.layout, tw.out_dtype)
    quantized = is_quantized_weight(tw)
    if quantized:
        # Quantized once from verified sources and proven within its bound (quantized.py): the read-back
        # below compares the file with this tensor instead of quantizing it again after writing.
        pieces: Iterable[torch.Tensor] = [ahead.take(tw)]
    elif is_quantized_scale(tw):  # a scalar, from the source pieces' min and max; compared with the weight's after writing
        pieces = [quantized_scale(tw, states)]
    elif tw.transform is not None:
        pieces = [transformed_tensor(tw, states)]
    else:
        # Finiteness: folded into the read-back for streamed tensors, proven by the cast's
        # own output check for cast ones (a cast keeps inf/nan); scanned here otherwise.
        # A streamed tensor's pieces are only bytes here and in the read-back: read in place, never copied.
        chunks = verified_chunks(tw.layout, states, check_values=not (streamed or cast_pieces), in_place=streamed)
        pieces = global_pieces(tw.layout, chunks, tw.out_dtype, tw.name)
        if cast_pieces:
            pieces = list(pieces)  # kept until the read-back has compared them with the file
    written = 0
    for piece in pieces:
        raise_if_stopped()
        written += writer.write(_as_bytes(piece))
    if streamed:
        follow.submit(tw, begin=begin)
    elif cast_pieces or quantized:
        follow.submit(tw, list(pieces), begin=begin)
    return written


def streamed_parts(tw: TensorWrite) -> list[TensorWrite] | None:
    """The checkpoint tensors whose bytes, one after another, are `tw`'s (an original layout's fused row
    blocks), each a write of its own; None when `tw` is not such a tensor.

    Only sources in rank order qualify: each is then streamed from its rank pieces (or cast piece by
    piece) and compared with them by the read-back, exactly as a plain tensor is.
    """
    spec = tw.transform
    if not isinstance(spec, ArchitectureOp) or not adapter_for_op(spec.op).concatenates(spec):
        return None
    sources = spec.inputs
    if not all(isinstance(s, CheckpointSource) and in_rank_order(s.layout) for s in sources):
        return None  # a fused LoRA weight or another layout: computed whole, verified by recomputing it
    return [TensorWrite(f"{tw.name} (rows of {s.layout.key})", s.layout.key, s.layout, tw.out_dtype)
            for s in sources if isinstance(s, CheckpointSource)]


def open_tensors(path: Path, expected_metadata: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
    """Map a safetensors file read-only-in-effect (MAP_PRIVATE) and view each tensor in it."""
    entries, metadata, data_start = read_header(path)
    expected_metadata = expected_metadata or HEADER_METADATA
    if metadata != expected_metadata:
        raise CheckpointError(f"{path.name}: header metadata is {metadata}, expected {expected_metadata}")
    size = path.stat().st_size
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        raw = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
    out = {}
    for name, e in entries.items():
        out[name] = raw[data_start + e.begin : data_start + e.end].view(torch_dtype(e.dtype)).reshape(e.shape)
    return out


def verify_written_shard(path: Path, shard: ShardPlan, states: PieceSource, header: bytes,
                         metadata: dict[str, str] | None = None) -> None:
    """Layers 2 and 3 for what the read-back during writing did not cover.

    Streamed, cast and float8 weights were compared while the file was written (FollowingReadBack).
    Here: the header bytes, the file size, names, shapes and dtypes as safetensors reads
    them, and every other computed tensor (concatenated, fused). Together every byte of the file
    is compared with what was meant to be written, so the sha256 hashed while writing is
    the file's sha256 without reading the file a second time.
    """
    from safetensors import safe_open

    if path.stat().st_size != len(header) + shard.nbytes:
        raise CheckpointError(f"{path.name} is {path.stat().st_size} bytes, expected {len(header) + shard.nbytes}")
    with open(path, "rb", buffering=0) as handle:
        on_disk = bytearray(len(header))
        read_exact(handle, memoryview(on_disk), path.name)
    if on_disk != header:
        raise CheckpointError(f"{path.name}: the header read back differs from the header written")
    with safe_open(str(path), framework="pt") as handle:
        names = set(handle.keys())
        for tw in shard.tensors:
            if tw.name not in names:
                raise CheckpointError(f"{path.name}: {tw.name} is missing after writing")
            sl = handle.get_slice(tw.name)
            if tuple(sl.get_shape()) != tw.layout.shape or sl.get_dtype() != DTYPES[tw.out_dtype][0]:
                raise CheckpointError(f"{path.name}: {tw.name} was written with the wrong shape or dtype")
    if names != {t.name for t in shard.tensors}:
        raise CheckpointError(f"{path.name}: holds tensors that were not planned")
    computed = [tw for tw in shard.tensors if not read_back_while_writing(tw) and not is_quantized_weight(tw)]
    if not computed:
        return
    tensors = open_tensors(path, metadata or shard.metadata)
    for tw in computed:
        if tw.transform is not None:
            verify_transformed(tw, tensors[tw.name], states)
        else:
            verify_round_trip(tw.layout, tensors[tw.name], primary_chunks(tw.layout, states), tw.out_dtype, tw.name)


def read_back_while_writing(tw: TensorWrite) -> bool:
    """Streamed and cast-in-rank-order tensors (and the parts of a streamed fused tensor, which are always
    one or the other) are compared by the read-back that follows the writer."""
    if tw.transform is None:
        return is_streamed(tw.layout, tw.out_dtype) or is_cast_in_rank_order(tw.layout, tw.out_dtype)
    return streamed_parts(tw) is not None


def reusable_record(record_path: Path, final: Path, shard: ShardPlan, needs: str | None = None) -> ShardRecord | None:
    """A shard from an earlier attempt counts only if its record matches and its bytes hash the same
    (`needs`: a field the record must also hold as an object, a writer's own record of the file)."""
    if not record_path.is_file() or not final.is_file():
        return None
    try:
        data = json.loads(record_path.read_text())
        recorded = (data["file_name"], data["sha256"], data["size"], data["plan_fingerprint"])
        tensors = {k: (v[0], tuple(v[1])) for k, v in data["tensors"].items()}
        data_sha256 = data.get("data_sha256")
        if needs is not None and not isinstance(data[needs], dict):
            return None
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    if recorded[3] != shard.fingerprint or final.stat().st_size != recorded[2]:
        return None
    stamp = FileStamp.of(final)
    # The ranges again, in the same pass (the record may predate them), where the plan takes them.
    digest, ranges = file_digests(final, sha256_file, shard.ranges)
    if digest != recorded[1] or FileStamp.of(final) != stamp:
        return None
    return ShardRecord(file_name=recorded[0], sha256=recorded[1], size=recorded[2], tensors=tensors,
                       plan_fingerprint=recorded[3], verified_stamp=stamp, data_sha256=data_sha256, ranges=ranges)


def write_component_config(src: Path, dst: Path, base_dir: str) -> tuple[bytes, list[str]]:
    """Write the trained component's config.json by the rule every copied config follows
    (`strip_local_paths`: local-path keys removed, key order kept); returns (bytes, removed keys).

    `base_dir` ("" when the base is only a Hub name) is the base's directory: a config that
    still names it after the removal is refused rather than published.
    """
    rel = src.relative_to(base_dir).as_posix() if base_dir and src.is_relative_to(base_dir) else src.name
    raw, removed = strip_local_paths(rel, current_session().read_bytes(src), base_dir)  # read once per export
    dst.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_durable(dst, raw)
    return raw, removed


def write_weight_index(output: OutputPlan, weights_name: str, tensor_dir: Path) -> bytes | None:
    """The Diffusers index file for multi-shard output (None for a single file)."""
    if not output.indexed:
        return None
    weight_map = {t.name: s.file_name for s in output.shards for t in s.tensors}
    index = {"metadata": {"total_size": output.total_size}, "weight_map": dict(sorted(weight_map.items()))}
    return write_json_durable(tensor_dir / f"{weights_name}.index.json", index, indent=2)
