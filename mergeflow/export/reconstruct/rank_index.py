"""Indexing one rank file (safe loading, per-key metadata) and the sha256 the manifest records of it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from mergeflow.errors import CheckpointError, InputChangedError
from mergeflow.formats.rank_files import describe_state
from mergeflow.formats.zip_records import sha256_and_check_records
from mergeflow.io.fs import FileStamp
from mergeflow.io.session import current_session
from mergeflow.records import RankIndex
from mergeflow.sources.verl import RankStates


def index_rank_file(actor_dir: Path, file_name: str, rank: int, *, trust_checkpoint: bool = False) -> RankIndex:
    """Load one rank file safely and describe every tensor (reads the pickle's metadata, not the data)."""
    path = actor_dir / file_name
    before = FileStamp.of(path)
    # Loaded through the shared cache, so the shard writers in this process reuse the parsed file.
    state = RankStates(actor_dir, (file_name,), trust_checkpoint=trust_checkpoint).state(0)
    entries = describe_state(state, file_name)
    if FileStamp.of(path) != before:
        raise InputChangedError(f"rank file {file_name} changed while it was being read; wait until training has finished saving")
    return RankIndex(rank=rank, file_name=file_name, size=before.size, entries=entries)


def hash_rank_file(actor_dir: Path, file_name: str, planned: FileStamp | None = None,
                   hasher: Callable[[Path], str] = sha256_and_check_records) -> str:
    """sha256 of one checkpoint file; for a verl rank file every record is checked against its CRC-32 in the same pass.

    Refused if the file is damaged, is not the one inspect planned, or changes meanwhile.
    `hasher` is the checkpoint source's (mergeflow.sources.base.CheckpointSource.file_hasher).
    """
    path = actor_dir / file_name
    before = FileStamp.of(path)
    if planned is not None and before != planned:
        raise InputChangedError(f"rank file {file_name} changed during the export (after it was planned); rerun once it is stable")
    try:
        # Usually hashed and checked in the background since inspection, for this very stamp (mergeflow.io.prefetch);
        # a digest prefetched without the CRC checks is not taken.
        digest = current_session().digests.take(path, before, hasher=hasher) or hasher(path)
    except CheckpointError:
        _unchanged_while_hashed(path, file_name, before)  # a file being rewritten is changing, not damaged
        raise
    _unchanged_while_hashed(path, file_name, before)
    return digest


def _unchanged_while_hashed(path: Path, file_name: str, before: FileStamp) -> None:
    if FileStamp.of(path) != before:
        raise InputChangedError(f"rank file {file_name} changed during the export, while it was hashed; "
                                "wait until training has finished saving")
