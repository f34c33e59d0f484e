"""The tasks that say where every tensor's pieces are: per-file indexes combined, or the checkpoint's metadata read once."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from mergeflow.export.reconstruct.layout import rank_layouts
from mergeflow.records import MergePlan, RankIndex, TensorLayout
from mergeflow.sources.registry import source_named
from mergeflow.tasks import RETRY_IO


@task(name="combine-rank-layouts", task_run_name="combine-rank-layouts", cache_policy=NO_CACHE)
def combine_rank_layouts(indexes: list[RankIndex]) -> dict[str, TensorLayout]:
    """Check that the ranks agree and say, per key, which rank holds which chunk (torch.chunk arithmetic)."""
    return rank_layouts(indexes)


@task(name="index-dcp", task_run_name="index-dcp-metadata", **RETRY_IO, cache_policy=NO_CACHE)
def index_dcp(plan: MergePlan) -> dict[str, TensorLayout]:
    """Indexing.METADATA (a DCP's `.metadata`, read safely): every tensor's chunks, checked to tile it and to lie
    inside their files."""
    return source_named(plan.checkpoint.format).read_layouts(plan.checkpoint, trust_checkpoint=plan.options.trust_checkpoint)
