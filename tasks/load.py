"""The load-rank and hash-rank tasks: one checkpoint file each (a DCP's too, for hashing), cached by the file's stamp."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefect import task

from mergeflow.io.fs import FileStamp
from mergeflow.records import MergePlan, RankIndex
from mergeflow.sources.registry import file_hasher, source_named
from mergeflow.sources.verl_ranks import hash_rank_file
from mergeflow.tasks import RETRY_IO


def _rank_cache_key(context: Any, parameters: Mapping[str, Any]) -> str:
    plan: MergePlan = parameters["plan"]
    path = Path(plan.checkpoint.actor_dir) / plan.checkpoint.rank_files[parameters["rank"]]
    stamp = FileStamp.of(path)
    raw = f"{path}|{stamp}|{plan.options.trust_checkpoint}|{context.task.name}-v3"  # v3: DCP records CRC-checked in the hash pass
    return "rank-" + hashlib.sha256(raw.encode()).hexdigest()


@task(
    name="load-rank-shards",
    task_run_name="load-rank-{rank:05d}",
    **RETRY_IO,
    cache_key_fn=_rank_cache_key,
    persist_result=True,
)
def load_rank_shards(plan: MergePlan, rank: int) -> RankIndex:
    """Open one rank file safely and record its tensors' layout (Indexing.PER_FILE)."""
    return source_named(plan.checkpoint.format).index_file(plan.checkpoint, rank, trust_checkpoint=plan.options.trust_checkpoint)


@task(
    name="hash-rank-file",
    task_run_name="hash-rank-{rank:05d}",
    **RETRY_IO,
    cache_key_fn=_rank_cache_key,
    persist_result=True,
)
def hash_rank(plan: MergePlan, rank: int) -> str:
    """sha256 of one rank file for the manifest; runs beside the shard writers, not before them."""
    actor_dir, name = Path(plan.checkpoint.actor_dir), plan.checkpoint.rank_files[rank]
    return hash_rank_file(actor_dir, name, plan.input_stamps.get(str(actor_dir / name)), file_hasher(plan.checkpoint.format, plan.options.trust_checkpoint))
