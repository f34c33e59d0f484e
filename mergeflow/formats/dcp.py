"""torch Distributed Checkpoint (DCP) input: `.metadata` + `__R_0.distcp`, as accelerate, VeOmni and torchtitan save.

The layout is torch's (torch/distributed/checkpoint/filesystem.py, torch 2.13): `.metadata` pickles a
`Metadata` whose `state_dict_metadata[key]` gives each tensor's global size, dtype and chunks
(offsets, sizes), and whose `storage_data[MetadataIndex(key, chunk offsets)]` says where a chunk's
bytes are: (relative file, byte offset, length). The default writer stores each chunk with
`torch.save(chunk)` at that byte range, so a chunk is read with torch's safe loader
(`weights_only=True`) on exactly that range, never by full unpickling.

A DCP becomes a second source of rank pieces: every key's chunks tile it along at most one dimension
(checked here), mergeflow/sources/dcp.py turns that into a `TensorLayout` whose "ranks" are
the chunks, and `DcpChunks.local(chunk, key)` plays the part of `RankStates.local(rank, key)`, so
reconstruct's one path (verified_chunks -> global_pieces -> verify_round_trip) assembles both.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import torch

from mergeflow.errors import (
    CheckpointError,
    InputChangedError,
    ShardLayoutError,
    UnsafeCheckpointError,
)
from mergeflow.formats import dcp_mapped, dcp_pickle
from mergeflow.formats.dcp_layout import (
    METADATA,
    SUFFIX,
    dcp_files,
    not_a_dcp_dir,
    regular_file,
)
from mergeflow.formats.rank_pickle import MappedFile, NotFastReadable, map_file
from mergeflow.formats.zip_records import (
    ByteRange,
    StoredRecord,
    embedded_records,
    sha256_and_check,
)
from mergeflow.io.fs import HASH_BLOCK, FileStamp
from mergeflow.io.session import current_session
from mergeflow.io.stamped_cache import StampedCache

# Module names that wrappers put in front of the Diffusers model's own state-dict names:
# accelerate saves {"model": state_dict} (DCP flattens it to "model."), PEFT adds "base_model.model.",
# DDP "module.", FSDP1 "_fsdp_wrapped_module." anywhere, torch.compile "_orig_mod.".
_LEADING = ("model.", "base_model.model.", "module.", "_orig_mod.")
_ANYWHERE = ("_fsdp_wrapped_module.", "_orig_mod.")


@dataclass(frozen=True)
class ChunkSource:
    """Where one chunk of one tensor lives: its place in the global tensor and its byte range."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str
    offset: int
    length: int


@dataclass(frozen=True)
class DcpTensor:
    """One tensor of a DCP: its global size and dtype, and its chunks in order along `shard_dim`."""

    name: str  # the Diffusers state-dict name (wrappers stripped)
    key: str  # the key as saved, which `.metadata` and the chunk reads use
    dtype: str
    shape: tuple[int, ...]
    shard_dim: int | None  # None: one chunk holds the whole tensor
    chunks: tuple[ChunkSource, ...]  # sorted by offset

    @property
    def chunk_shapes(self) -> tuple[tuple[int, ...], ...]:
        return tuple(c.sizes for c in self.chunks)


@dataclass(frozen=True)
class DcpCheckpoint:
    """A parsed DCP directory: every tensor, by Diffusers name, and the files it reads."""

    directory: Path
    tensors: dict[str, DcpTensor]
    files: tuple[str, ...]  # .metadata and every .distcp, sorted

    def records(self, file: str) -> list[tuple[ChunkSource, str]]:
        """The `torch.save` records of one `.distcp` in file order, each with its tensor's key."""
        found = [(c, t.key) for t in self.tensors.values() for c in t.chunks if c.file == file]
        return sorted(found, key=lambda item: item[0].offset)


def read_metadata(directory: Path, *, trust_checkpoint: bool = False) -> Any:
    """`.metadata` loaded with the closed unpickler; full unpickling only with --trust-checkpoint."""
    problem = not_a_dcp_dir(directory)
    if problem or not (directory / METADATA).exists():
        raise CheckpointError(problem or f"{directory.name}/ has no {METADATA}: it is not a torch Distributed Checkpoint")
    data = current_session().read_bytes(regular_file(directory / METADATA))  # once per export: the hash pass shares it
    try:
        return dcp_pickle.load_metadata(data)
    except dcp_pickle.NotSafeMetadata as exc:
        if not trust_checkpoint:
            raise UnsafeCheckpointError(
                f"{METADATA} in {directory.name}/ holds objects outside torch's checkpoint metadata ({exc}); "
                "loading it would run arbitrary code. Pass --trust-checkpoint only if you trust its origin"
            ) from None
    except Exception as exc:  # truncated or corrupt pickle bytes
        raise CheckpointError(f"{METADATA} in {directory.name}/ is truncated or damaged ({type(exc).__name__}: {exc}); "
                              "copy the checkpoint again") from None
    try:
        return pickle.loads(data)  # trusted: torch's own reader does exactly this
    except Exception as exc:
        raise CheckpointError(f"{METADATA} in {directory.name}/ could not be loaded even with --trust-checkpoint "
                              f"({type(exc).__name__}: {exc})") from None


def model_name(key: str) -> str:
    """The Diffusers state-dict name of a DCP key: wrapper prefixes and segments removed."""
    for segment in _ANYWHERE:
        key = key.replace(segment, "")
    changed = True
    while changed:
        changed = False
        for prefix in _LEADING:
            if key.startswith(prefix):
                key, changed = key[len(prefix):], True
    return key


def open_dcp(directory: Path, *, trust_checkpoint: bool = False) -> DcpCheckpoint:
    """Parse a DCP directory: every tensor's chunks and byte ranges, checked against the files present."""
    metadata = read_metadata(directory, trust_checkpoint=trust_checkpoint)
    try:
        return _parse(directory, metadata)
    except (AttributeError, TypeError, ValueError) as exc:  # well-formed pickle, wrong shapes inside
        raise CheckpointError(f"{METADATA} in {directory.name}/ is malformed ({type(exc).__name__}: {exc}); "
                              "it was not written by torch.distributed.checkpoint.save") from None


def _parse(directory: Path, metadata: Any) -> DcpCheckpoint:
    entries = getattr(metadata, "state_dict_metadata", None)
    storage = getattr(metadata, "storage_data", None)
    if not isinstance(entries, dict) or not isinstance(storage, dict):
        raise CheckpointError(f"{METADATA} in {directory.name}/ has no tensor table; it is not a DCP model checkpoint")
    places = {(index.fqn, tuple(int(n) for n in index.offset)): info for index, info in storage.items()}
    named = {info.relative_path for info in storage.values()}
    sizes = _file_sizes(directory, named)
    # A .distcp that .metadata does not name is another save's (torch overwrites __R_0.distcp but never removes
    # the files of a save with more ranks): refused like verl's stale rank files, not hashed into the manifest.
    unexpected = sorted(set(dcp_files(directory)[1:]) - named)
    if unexpected:
        raise CheckpointError(f"unexpected DCP file(s) {', '.join(unexpected[:3])}{' ...' if len(unexpected) > 3 else ''} "
                              f"in {directory.name}/ that its {METADATA} does not name (stale files from another save?); "
                              "remove them or copy the checkpoint again")
    tensors: dict[str, DcpTensor] = {}
    for key in sorted(entries):
        tensor = _tensor(key, entries[key], places, sizes, directory.name)
        if tensor.name in tensors:
            raise CheckpointError(f"keys {tensors[tensor.name].key} and {key} name the same tensor "
                                  "after removing wrapper prefixes")
        tensors[tensor.name] = tensor
    return DcpCheckpoint(directory, tensors, dcp_files(directory))


def _file_sizes(directory: Path, names: set[str]) -> dict[str, int]:
    sizes = {}
    for name in sorted(names):
        if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", "..") or not name.endswith(SUFFIX):
            raise CheckpointError(f"{METADATA} in {directory.name}/ names an unsafe data file {name!r}")
        path = directory / name
        if path.is_symlink() or not path.exists():
            raise CheckpointError(f"{METADATA} in {directory.name}/ names {name}, which is missing; "
                                  "the checkpoint is incomplete: copy the whole directory again")
        sizes[name] = regular_file(path).stat().st_size
    return sizes


def _tensor(key: str, entry: Any, places: dict, sizes: dict[str, int], dir_name: str) -> DcpTensor:
    if not isinstance(key, str) or not hasattr(entry, "chunks"):
        raise CheckpointError(f"{key!r} in {dir_name}/ is not a tensor (bytes or an object); "
                              "only model weights can be exported")
    dtype = str(entry.properties.dtype).removeprefix("torch.")
    shape = tuple(int(n) for n in entry.size)
    chunks: list[ChunkSource] = []
    for chunk in entry.chunks:
        offsets, chunk_sizes = tuple(int(n) for n in chunk.offsets), tuple(int(n) for n in chunk.sizes)
        info = places.get((key, offsets))
        if info is None:
            raise CheckpointError(f"{key}: chunk at {list(offsets)} has no storage entry in {METADATA}; the checkpoint is damaged")
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{key}: chunk stored with transforms {list(info.transform_descriptors)} "
                                  "(compressed DCP); save without storage extensions")
        end = int(info.offset) + int(info.length)
        if int(info.offset) < 0 or int(info.length) <= 0 or end > sizes[info.relative_path]:
            raise CheckpointError(f"{info.relative_path} is truncated: {key} needs bytes up to {end:,} but the file has "
                                  f"{sizes[info.relative_path]:,}; copy the checkpoint again")
        chunks.append(ChunkSource(offsets, chunk_sizes, info.relative_path, int(info.offset), int(info.length)))
    chunks.sort(key=lambda c: c.offsets)
    return DcpTensor(model_name(key), key, dtype, shape, _shard_dim(key, shape, chunks), tuple(chunks))


def _shard_dim(key: str, shape: tuple[int, ...], chunks: list[ChunkSource]) -> int | None:
    """The one dimension the chunks tile in order (None for one whole chunk); anything else is refused."""
    if len(chunks) == 1 and chunks[0].sizes == shape and not any(chunks[0].offsets):
        return None
    varying = {d for c in chunks for d, (o, s) in enumerate(zip(c.offsets, c.sizes)) if o != 0 or s != shape[d]}
    if len(varying) != 1:
        raise ShardLayoutError(f"{key} is split on {len(varying)} dimensions in the DCP (tensor parallel?); "
                               "only pieces along one dimension (FSDP) can be reassembled")
    dim = varying.pop()
    position = 0
    for chunk in chunks:
        if len(chunk.offsets) != len(shape) or chunk.offsets[dim] != position:
            raise ShardLayoutError(f"{key}: DCP chunks do not tile the tensor along dim {dim} (gap or overlap at {position})")
        position += chunk.sizes[dim]
    if position != shape[dim]:
        raise ShardLayoutError(f"{key}: DCP chunks cover {position} of {shape[dim]} rows along dim {dim}")
    return dim


class DcpChunks:
    """Chunk tensors of a DCP, read on demand from their byte ranges: the DCP side of `RankStates.local`.

    Each chunk is read in place from its file's mapping (dcp_mapped: one mapping per file, held while
    these chunks are in use, and by every tensor viewing it); a record that reader does not know is
    read with torch's loader instead, with that loader's verdict and messages.
    """

    def __init__(self, checkpoint: DcpCheckpoint) -> None:
        self.checkpoint = checkpoint
        self._by_key = {t.key: t for t in checkpoint.tensors.values()}
        self._mapped: dict[str, MappedFile | None] = {}  # None: the file could not be mapped
        self._lock = threading.Lock()

    def local(self, chunk: int, key: str) -> torch.Tensor:
        return self._read(chunk, key, align=True).contiguous()

    def local_in_place(self, chunk: int, key: str) -> torch.Tensor:
        """The chunk viewing its file's mapping even at an odd offset (bytes only: see PieceSource)."""
        tensor = self._read(chunk, key, align=False)
        # Made contiguous by a kernel, a misaligned chunk would be read as its dtype: `local` copies it aligned.
        return tensor if tensor.is_contiguous() else self.local(chunk, key)

    def _read(self, chunk: int, key: str, *, align: bool) -> torch.Tensor:
        source = self._by_key[key].chunks[chunk]
        path = self.checkpoint.directory / source.file
        if os.path.getsize(path) < source.offset + source.length:
            raise CheckpointError(f"{source.file} is truncated: {key} needs {source.length:,} bytes at {source.offset:,}; "
                                  "copy the checkpoint again")
        tensor = self._mapped_chunk(source, key, align)
        if tensor is None:
            tensor = _load_chunk(path, source, key)
        if tuple(tensor.shape) != source.sizes:
            raise CheckpointError(f"{source.file}: {key} chunk at {list(source.offsets)} holds {list(tensor.shape)}, "
                                  f"{METADATA} says {list(source.sizes)}")
        return tensor

    def _mapped_chunk(self, source: ChunkSource, key: str, align: bool) -> torch.Tensor | None:
        """The chunk viewing its file's mapping; None where only torch's loader can read it."""
        mapped = self._mapping(source.file)
        if mapped is None:
            return None
        try:
            return dcp_mapped.read_chunk(mapped, source.offset, source.length, f"{key} (chunk at {list(source.offsets)})",
                                         align=align)
        except NotFastReadable:
            return None

    def _mapping(self, file: str) -> MappedFile | None:
        with self._lock:  # the shard tasks' threads ask at once: one mapping per file
            if file not in self._mapped:
                try:
                    self._mapped[file] = map_file(self.checkpoint.directory / file)
                except (NotFastReadable, OSError, ValueError):  # an empty file, a filesystem without mmap
                    self._mapped[file] = None
            return self._mapped[file]


def _load_chunk(path: Path, source: ChunkSource, key: str) -> torch.Tensor:
    """One chunk read by torch's safe loader from its byte range (a copy): records the mapped reader leaves."""
    try:
        with open(path, "rb") as handle:
            # torch reads the record from its byte range itself: no Python copy of the chunk first
            tensor = torch.load(ByteRange(handle, source.offset, source.length), map_location="cpu", weights_only=True)
    except Exception as exc:  # damage, or a payload the safe loader refuses
        raise CheckpointError(f"{source.file}: the bytes of {key} at {source.offset:,} are damaged or not a tensor "
                              f"({type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}); "
                              "copy the checkpoint again") from None
    if type(tensor) is torch.nn.Parameter:
        # dcp.save of a state dict holding Parameters (named_parameters(), state_dict(keep_vars=True))
        # torch.saves each chunk as a Parameter: the same bytes, which the safe loader rebuilds as one.
        tensor = tensor.detach()
    if type(tensor) is not torch.Tensor:
        raise CheckpointError(f"{source.file}: the record of {key} at {source.offset:,} holds a "
                              f"{type(tensor).__module__}.{type(tensor).__qualname__}, not a tensor; "
                              "only plain tensors (or Parameters) can be exported")
    return tensor


# --- the parsed `.metadata`, once per process, and the hash pass that CRC-checks every record ---------------

def parsed_dcp(directory: Path, *, trust_checkpoint: bool = False) -> DcpCheckpoint:
    """`open_dcp`, parsed once per `.metadata` stamp in this export (its session): the shard tasks and the hash pass share it."""
    stamp = FileStamp.of(directory / METADATA)

    def load() -> DcpCheckpoint:
        checkpoint = open_dcp(directory, trust_checkpoint=trust_checkpoint)
        if FileStamp.of(directory / METADATA) != stamp:
            raise InputChangedError(f"{METADATA} in {directory.name}/ changed while it was read; "
                                    "wait until the save has finished")
        return checkpoint

    parsed: StampedCache[DcpCheckpoint] = current_session().cache("dcp-parsed", capacity=8)
    return parsed.get_or_load((str(directory), stamp, trust_checkpoint), load)


def _check_records(path: Path, trust_checkpoint: bool, block: int = HASH_BLOCK) -> str:
    """sha256 of one DCP file; for a `.distcp`, every record of every chunk's `torch.save` archive is checked
    against its CRC-32 in the same sequential read (torch's loader checks none: a flipped bit loads silently).

    `.metadata` is a plain pickle without CRCs: hashed only (its damage fails the parse or the chunk ranges).
    """
    if path.name == METADATA:
        return hashlib.sha256(current_session().read_bytes(regular_file(path))).hexdigest()  # the bytes the parse reads
    checkpoint = parsed_dcp(path.parent, trust_checkpoint=trust_checkpoint)
    if path.name not in checkpoint.files:  # the parse refuses files .metadata does not name: not expected here
        raise CheckpointError(f"{path.name} in {path.parent.name}/ is not named by its {METADATA}; remove it")

    def records_of(handle: BinaryIO) -> list[StoredRecord]:
        # Each archive's central directory: a few small reads at the end of its range, before the pass.
        records: list[StoredRecord] = []
        for chunk, key in checkpoint.records(path.name):
            label = f"{key} (chunk at {list(chunk.offsets)})"
            found = embedded_records(handle, chunk.offset, chunk.length, label)
            if not found:
                raise CheckpointError(f"DCP file {path.name} is damaged: the record of {label} at bytes {chunk.offset:,}-"
                                      f"{chunk.offset + chunk.length:,} is not a readable torch.save archive (its zip "
                                      "directory is damaged); copy it again from the training run")
            records.extend(found)
        return records

    return sha256_and_check(path, records_of, f"DCP file {path.name}", block)


# Two functions, not one with a flag: the digest prefetch hands a verdict only to the same hasher
# (mergeflow.io.prefetch), and what parsed only with --trust-checkpoint must not serve a run without it.
def sha256_and_check_distcp(path: Path) -> str:
    """The manifest's sha256 of a DCP file, every `.distcp` record CRC-checked on the way (closed `.metadata` reader)."""
    return _check_records(path, trust_checkpoint=False)


def sha256_and_check_distcp_trusted(path: Path) -> str:
    """As `sha256_and_check_distcp`, for an export run with --trust-checkpoint (`.metadata` fully unpickled)."""
    return _check_records(path, trust_checkpoint=True)


def source_files(checkpoint: DcpCheckpoint, *, trust_checkpoint: bool = False) -> dict[str, str]:
    """sha256 of `.metadata` and every `.distcp` (records CRC-checked), for the manifest's source_files."""
    return {name: _check_records(checkpoint.directory / name, trust_checkpoint) for name in checkpoint.files}


def file_size(checkpoint: DcpCheckpoint, name: str) -> int:
    return os.path.getsize(checkpoint.directory / name)
