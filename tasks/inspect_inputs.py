"""The inspect task: every decision about an export made from metadata, before any heavy work."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from mergeflow.config import ModelMergerConfig
from mergeflow.export.plan.build import build_plan
from mergeflow.records import MergePlan


@task(name="inspect", task_run_name="inspect-inputs", cache_policy=NO_CACHE)
def inspect_inputs(config: ModelMergerConfig) -> MergePlan:
    """Check flags, paths, checkpoint files and the base schema; plan the export."""
    return build_plan(config)
