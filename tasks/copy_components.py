"""The copy-components task: the base pipeline's other files, copied byte for byte and hash-verified."""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from mergeflow.export.write.copy_files import copy_base_files
from mergeflow.records import CopyResult, MergePlan
from mergeflow.tasks import RETRY_IO


@task(name="copy-components", task_run_name="copy-components", **RETRY_IO, cache_policy=NO_CACHE)
def copy_components(plan: MergePlan) -> CopyResult:
    """Copy the base pipeline's non-trained files into staging, each one hash-verified."""
    return copy_base_files(plan, workers=plan.options.workers)
