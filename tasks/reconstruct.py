"""The plan-reconstruction task: every key's layout over the ranks, checked against the base schema."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from mergeflow.export.reconstruct import plan_tensor_writes
from mergeflow.records import MergePlan, RankIndex, TensorWrite


@task(name="plan-reconstruction", task_run_name="plan-reconstruction", cache_policy=NO_CACHE)
def plan_reconstruction(plan: MergePlan, indexes: list[RankIndex]) -> list[TensorWrite]:
    """Check how every tensor is spread over the ranks and that it matches the base schema."""
    return plan_tensor_writes(plan, indexes)
