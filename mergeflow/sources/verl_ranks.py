"""verl's rank files one by one: the parsed files an export shares (RankStates), indexing one rank file
(safe loading, per-key metadata) and the sha256 the manifest records of it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from mergeflow.errors import CheckpointError, InputChangedError
from mergeflow.formats.rank_files import describe_state
from mergeflow.formats.zip_records import sha256_and_check_records
from mergeflow.io.fs import FileStamp
from mergeflow.io.session import current_session
from mergeflow.io.stamped_cache import StampedCache
from mergeflow.records import RankIndex

if TYPE_CHECKING:
    import torch

    from mergeflow.formats.rank_pickle import StateDict


class RankStates:
    """The rank files of one checkpoint, opened with mmap (no private memory) and shared by the export's tasks.

    Kept in the export's session (mergeflow.io.session): a long-running process (`mergeflow serve`)
    keeps no old checkpoint mapped once its export is over, so training can free their disk space.
    """

    def __init__(self, actor_dir: Path, rank_files: tuple[str, ...], *, trust_checkpoint: bool = False) -> None:
        from mergeflow.io.session import current_session

        self.paths = [actor_dir / name for name in rank_files]
        self.trust = trust_checkpoint
        self._cache: StampedCache[StateDict] = current_session().cache("verl-rank-states", capacity=64)

    def state(self, rank: int) -> StateDict:
        from mergeflow.formats.rank_files import (
            load_rank_state,  # torch: not on the pre-flight's path
        )

        path = self.paths[rank]
        return self._cache.get_or_load((str(path), FileStamp.of(path), self.trust),
                                       lambda: load_rank_state(path, trust_checkpoint=self.trust))

    def local(self, rank: int, key: str) -> torch.Tensor:
        from mergeflow.formats.rank_files import local_tensor

        try:
            return local_tensor(self.state(rank)[key])
        except KeyError:
            raise CheckpointError(f"rank file {self.paths[rank].name} no longer holds {key}; was it rewritten?") from None

    def local_in_place(self, rank: int, key: str) -> torch.Tensor:
        return self.local(rank, key)  # a rank file's storages are aligned (torch.save aligns them in the file)


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
