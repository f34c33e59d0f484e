"""The LoRA tasks of an export: validate every adapter, plan the model's tensors, write the adapter."""

from __future__ import annotations

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from mergeflow.lora.adapter_plan import lora_tensor_writes, plan_lora_export
from mergeflow.lora.adapter_writer import AdapterExport, write_adapter
from mergeflow.lora.extraction import Extraction, run_extraction
from mergeflow.lora.plan import LoraPlan
from mergeflow.outputs.registry import plan_output
from mergeflow.records import MergePlan, OutputPlan, TensorLayout
from mergeflow.tasks import RETRY_IO


@task(name="plan-lora", task_run_name="plan-lora", cache_policy=NO_CACHE)
def plan_lora(plan: MergePlan, layouts: dict[str, TensorLayout]) -> LoraPlan:
    """Validate every LoRA adapter (pairs, ranks, shapes, targets) and record what is fused or exported."""
    return plan_lora_export(plan, layouts)


@task(name="plan-lora-writes", task_run_name="plan-lora-writes", cache_policy=NO_CACHE)
def plan_lora_writes(plan: MergePlan, lora: LoraPlan, layouts: dict[str, TensorLayout]) -> OutputPlan:
    """Plan the model's tensors of a LoRA export: base weights, fused where asked, checked against the base;
    converted, mapped to the output's keys and packed into the output's files."""
    return plan_output(plan, lora_tensor_writes(plan, lora, layouts))


@task(name="write-lora-adapter", task_run_name="write-lora-adapter", **RETRY_IO, cache_policy=NO_CACHE)
def write_lora_adapter(plan: MergePlan, lora: LoraPlan, layouts: dict[str, TensorLayout],
                       rank_digests: dict[str, str], extraction: Extraction | None = None) -> AdapterExport:
    """Stream the selected adapter into lora_adapter/ with its PEFT (or Diffusers) config and manifest."""
    return write_adapter(plan, lora, layouts, rank_digests, extraction)


@task(name="extract-lora", task_run_name="extract-lora", **RETRY_IO, cache_policy=NO_CACHE)
def extract_lora(plan: MergePlan, layouts: dict[str, TensorLayout]) -> Extraction:
    """Every changed linear weight's dW = trained - base as truncated-SVD factors, one layer at a time."""
    logger = get_run_logger()
    step = [0]

    def report(done: int, total: int) -> None:
        tenth = done * 10 // max(total, 1)
        if tenth > step[0]:  # one line per tenth of the tensors
            step[0] = tenth
            logger.info("Compared %d/%d tensors with the base", done, total)

    return run_extraction(plan, layouts, report)
