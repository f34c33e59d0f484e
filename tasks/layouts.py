"""The tasks that say where every tensor's pieces are: verl's rank indexes combined, or a DCP's `.metadata`."""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from mergeflow.export.dcp_source import DcpSources, dcp_layouts
from mergeflow.export.layout import rank_layouts
from mergeflow.records import MergePlan, RankIndex, TensorLayout
from mergeflow.tasks import RETRY_IO


@task(name="combine-rank-layouts", task_run_name="combine-rank-layouts", cache_policy=NO_CACHE)
def combine_rank_layouts(indexes: list[RankIndex]) -> dict[str, TensorLayout]:
    """Check that the ranks agree and say, per key, which rank holds which chunk (torch.chunk arithmetic)."""
    return rank_layouts(indexes)


@task(name="index-dcp", task_run_name="index-dcp-metadata", **RETRY_IO, cache_policy=NO_CACHE)
def index_dcp(plan: MergePlan) -> dict[str, TensorLayout]:
    """Read a DCP's `.metadata` safely: every tensor's chunks, checked to tile it and to lie inside their files."""
    directory = Path(plan.checkpoint.actor_dir)
    return dcp_layouts(DcpSources.chunks(directory, trust_checkpoint=plan.options.trust_checkpoint).checkpoint)
