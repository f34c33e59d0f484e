"""The plan-reconstruction task: one write per checkpoint tensor, checked against the base schema, packed into files."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from mergeflow.export.reconstruct.rebuild import plan_tensor_writes
from mergeflow.outputs.registry import plan_output
from mergeflow.records import MergePlan, OutputPlan, TensorLayout


@task(name="plan-reconstruction", task_run_name="plan-reconstruction", cache_policy=NO_CACHE)
def plan_reconstruction(plan: MergePlan, layouts: dict[str, TensorLayout]) -> OutputPlan:
    """Check that the checkpoint's tensors are exactly the base schema's (names, shapes) and fix each output dtype;
    then convert them (an architecture adapter), map them to the output's keys and pack the output's files."""
    return plan_output(plan, plan_tensor_writes(plan, layouts))
