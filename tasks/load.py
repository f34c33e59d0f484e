"""Opening rank files: safe loading and per-key metadata; apart from it, the sha256 the manifest records."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from prefect import task

from mergeflow.errors import InputChangedError
from mergeflow.fsops import FileStamp, sha256_file
from mergeflow.prefetch import DigestPrefetch
from mergeflow.rank_files import describe_state
from mergeflow.records import MergePlan, RankIndex
from mergeflow.tasks.common import RETRY_IO
from mergeflow.tasks.reconstruct import RankStates


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
    # Usually hashed in the background since inspection, for this very stamp (mergeflow.prefetch).
    digest = DigestPrefetch.take(path, before) or sha256_file(path)
    if FileStamp.of(path) != before:
        raise InputChangedError(f"rank file {file_name} changed during the export, while it was hashed; "
                                "wait until training has finished saving")
    return digest


def _rank_cache_key(context: Any, parameters: dict[str, Any]) -> str:
    plan: MergePlan = parameters["plan"]
    path = Path(plan.actor_dir) / plan.rank_files[parameters["rank"]]
    stamp = FileStamp.of(path)
    raw = f"{path}|{stamp}|{plan.config.get('trust_checkpoint')}|{context.task.name}-v2"
    return "rank-" + hashlib.sha256(raw.encode()).hexdigest()


@task(
    name="load-rank-shards",
    task_run_name="load-rank-{rank:05d}",
    **RETRY_IO,
    cache_key_fn=_rank_cache_key,
    persist_result=True,
)
def load_rank_shards(plan: MergePlan, rank: int) -> RankIndex:
    """Open one rank file safely and record its tensors' layout."""
    return index_rank_file(
        Path(plan.actor_dir), plan.rank_files[rank], rank, trust_checkpoint=bool(plan.config.get("trust_checkpoint"))
    )


@task(
    name="hash-rank-file",
    task_run_name="hash-rank-{rank:05d}",
    **RETRY_IO,
    cache_key_fn=_rank_cache_key,
    persist_result=True,
)
def hash_rank(plan: MergePlan, rank: int) -> str:
    """sha256 of one rank file for the manifest; runs beside the shard writers, not before them."""
    actor_dir, name = Path(plan.actor_dir), plan.rank_files[rank]
    return hash_rank_file(actor_dir, name, plan.input_stamps.get(str(actor_dir / name)))
