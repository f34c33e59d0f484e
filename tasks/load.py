"""Opening rank files: safe loading, per-key metadata and the sha256 the manifest records."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

from prefect import task

from mergeflow.errors import InputChangedError
from mergeflow.fsops import FileStamp, sha256_file
from mergeflow.rank_files import describe_state, load_rank_state
from mergeflow.records import MergePlan, RankIndex
from mergeflow.tasks.common import retry_transient


def index_rank_file(actor_dir: Path, file_name: str, rank: int, *, trust_checkpoint: bool = False) -> RankIndex:
    """Load one rank file safely, describe every tensor and hash the file."""
    path = actor_dir / file_name
    before = FileStamp.of(path)
    state = load_rank_state(path, trust_checkpoint=trust_checkpoint)
    entries = describe_state(state, file_name)
    digest = sha256_file(path)
    if FileStamp.of(path) != before:
        raise InputChangedError(f"rank file {file_name} changed while it was being read; wait until training has finished saving")
    return RankIndex(rank=rank, file_name=file_name, sha256=digest, size=before.size, entries=entries)


def _rank_cache_key(context: Any, parameters: dict[str, Any]) -> str:
    plan: MergePlan = parameters["plan"]
    path = Path(plan.actor_dir) / plan.rank_files[parameters["rank"]]
    stamp = FileStamp.of(path)
    raw = f"{path}|{stamp}|{plan.config.get('trust_checkpoint')}|load-v1"
    return "rank-" + hashlib.sha256(raw.encode()).hexdigest()


@task(
    name="load-rank-shards",
    task_run_name="load-rank-{rank:05d}",
    retries=2,
    retry_delay_seconds=1,
    retry_condition_fn=retry_transient,
    cache_key_fn=_rank_cache_key,
    persist_result=True,
)
def load_rank_shards(plan: MergePlan, rank: int) -> RankIndex:
    """Open one rank file safely and record its tensors' layout and its sha256."""
    return index_rank_file(
        Path(plan.actor_dir), plan.rank_files[rank], rank, trust_checkpoint=bool(plan.config.get("trust_checkpoint"))
    )
