"""The write-shard task: one output shard, cached while the staged file is intact."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from prefect import task

from mergeflow.io.staging import staged_file_state, staging_id
from mergeflow.outputs.registry import output_of
from mergeflow.records import MergePlan, ShardPlan, ShardRecord
from mergeflow.sources.registry import open_pieces
from mergeflow.tasks import RETRY_IO


def _shard_cache_key(context: Any, parameters: Mapping[str, Any]) -> str:
    # The key must be the same before the first write (file absent) and on a rerun that finds
    # the file intact, yet differ once the staged file was changed or deleted, or the staging
    # directory was recreated: so a retry rewrites a damaged shard instead of trusting a stale record.
    plan: MergePlan = parameters["plan"]
    shard: ShardPlan = parameters["shard"]
    final = Path(plan.output.tensor_dir) / shard.file_name
    state = staged_file_state(final, Path(plan.output.work_dir) / f"shard-{shard.index:05d}.json")
    raw = f"{plan.output.staging}|{staging_id(Path(plan.output.staging))}|{shard.fingerprint}|{state}"
    return "shard-" + hashlib.sha256(raw.encode()).hexdigest()


@task(
    name="write-shard",
    task_run_name="write-shard-{shard.index:05d}",
    **RETRY_IO,
    cache_key_fn=_shard_cache_key,
    persist_result=True,
)
def write_shard(plan: MergePlan, shard: ShardPlan) -> ShardRecord:
    """Reconstruct, verify and stream one output shard into the staging directory."""
    states = open_pieces(plan.checkpoint, trust_checkpoint=plan.options.trust_checkpoint)  # rank files or DCP chunks
    artifact_dir = Path(plan.output.tensor_dir)
    artifact_dir.mkdir(parents=True, exist_ok=True)
    work_dir = Path(plan.output.work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    return output_of(plan).writer.write_file(shard, states, artifact_dir, work_dir)
