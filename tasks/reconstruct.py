"""The plan-reconstruction task: one write per checkpoint tensor, checked against the base schema."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from mergeflow.export.reconstruct.rebuild import plan_tensor_writes
from mergeflow.records import MergePlan, TensorLayout, TensorWrite


@task(name="plan-reconstruction", task_run_name="plan-reconstruction", cache_policy=NO_CACHE)
def plan_reconstruction(plan: MergePlan, layouts: dict[str, TensorLayout]) -> list[TensorWrite]:
    """Check that the checkpoint's tensors are exactly the base schema's (names, shapes) and fix each output dtype."""
    return plan_tensor_writes(plan, layouts)
