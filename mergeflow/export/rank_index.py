"""Indexing one rank file (safe loading, per-key metadata) and the sha256 the manifest records of it."""

from __future__ import annotations

from pathlib import Path

from mergeflow.errors import InputChangedError
from mergeflow.export.reconstruct import RankStates
from mergeflow.formats.rank_files import describe_state
from mergeflow.io.fs import FileStamp, sha256_file
from mergeflow.io.prefetch import DigestPrefetch
from mergeflow.records import RankIndex


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


def hash_rank_file(actor_dir: Path, file_name: str, planned: FileStamp | None = None) -> str:
    """sha256 of one rank file, refused if the file is not the one inspect planned or changes meanwhile."""
    path = actor_dir / file_name
    before = FileStamp.of(path)
    if planned is not None and before != planned:
        raise InputChangedError(f"rank file {file_name} changed during the export (after it was planned); rerun once it is stable")
    # Usually hashed in the background since inspection, for this very stamp (mergeflow.io.prefetch).
    digest = DigestPrefetch.take(path, before) or sha256_file(path)
    if FileStamp.of(path) != before:
        raise InputChangedError(f"rank file {file_name} changed during the export, while it was hashed; "
                                "wait until training has finished saving")
    return digest
