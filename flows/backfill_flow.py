"""The backfill as a Prefect flow: each step's export runs as a merge subflow (UI, deployments, the API)."""

from __future__ import annotations

from prefect import flow, get_run_logger

from mergeflow.config import DEFAULT_DTYPE, DEFAULT_OUTPUT_FORMAT, ModelMergerConfig
from mergeflow.flows.backfill import BackfillSettings, backfill, summary
from mergeflow.flows.merge import merge_flow
from mergeflow.io.jsonfiles import JsonObject


@flow(name="mergeflow-backfill", flow_run_name="backfill-{run_name}", persist_result=True, validate_parameters=True)
def backfill_flow(train_dir: str, base_model: str, target_root: str, run_name: str | None = None,
                  output_format: str = DEFAULT_OUTPUT_FORMAT, dtype: str = DEFAULT_DTYPE, allow_unchanged: bool = False,
                  stable_seconds: float = 5.0) -> JsonObject:
    """Export every complete, unpublished global_step_N of a training run, oldest first."""
    logger = get_run_logger()
    settings = BackfillSettings(train_dir, base_model, target_root, run_name, output_format, dtype, allow_unchanged,
                                stable_seconds)

    def merge(config: ModelMergerConfig) -> object:
        config.validate()
        return merge_flow(config=config)

    return summary(backfill(settings, merge, report=lambda r: logger.info("%s", r.line())))
