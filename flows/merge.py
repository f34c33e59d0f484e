"""The merge flow, as the card's steps: inspect -> load ranks (or index a DCP) -> hash ranks -> plan (LoRA) ->
write shards, copy components -> guard unchanged -> metadata -> validate -> publish -> upload.

It imports tasks, records and the flows layer's helpers only (tests/test_merge_flow.py checks it): each
step's work is a task; what must stay in the flow's process (the target lock) is flows/export_run.py.
"""

from __future__ import annotations

import time
from typing import Any

from prefect import get_run_logger
from prefect.context import FlowRunContext
from prefect.futures import PrefectFuture
from prefect.runtime import flow_run
from prefect.utilities.annotations import opaque

from mergeflow.config import ModelMergerConfig, PublishedMerge, UploadOutcome
from mergeflow.errors import UploadError
from mergeflow.flows.artifacts import (
    publish_manifest_artifacts,
    start_progress,
)
from mergeflow.flows.export_run import (
    enter_export_session,
    index_units,
    indexed_by_metadata,
    indexed_note,
    prepare_staging,
    target_locked,
    typed_os_errors,
)
from mergeflow.flows.heartbeats import skip_heartbeat_join
from mergeflow.flows.interrupts import name_the_kept_staging
from mergeflow.flows.prefect_flow import flow
from mergeflow.flows.progress import (
    HASHING,
    INSPECTING,
    LOADING,
    PUBLISHING,
    SMOKING,
    UPLOADING,
    VALIDATING,
    RunProgress,
    merge_progress,
)
from mergeflow.flows.run_names import export_label
from mergeflow.records import (
    Manifest,
    MergePlan,
    ShardRecord,
    SmokeSettings,
    TensorLayout,
    ValidationReport,
)
from mergeflow.tasks.copy_components import copy_components
from mergeflow.tasks.inspect_inputs import inspect_inputs
from mergeflow.tasks.layouts import combine_rank_layouts, index_dcp
from mergeflow.tasks.load import hash_rank, load_rank_shards
from mergeflow.tasks.lora import (
    extract_lora,
    plan_lora,
    plan_lora_writes,
    write_lora_adapter,
)
from mergeflow.tasks.publish import publish, seal, write_metadata
from mergeflow.tasks.reconstruct import plan_reconstruction
from mergeflow.tasks.smoke import runtime_check_staged_task
from mergeflow.tasks.upload import upload_to_hub
from mergeflow.tasks.validate import guard_unchanged_task, validate_staged_task
from mergeflow.tasks.write import write_shard

skip_heartbeat_join()  # a flow run ends without waiting for its heartbeat thread (flows/heartbeats.py)


def merge_run_name() -> str:
    """`merge-<run>-step<N>` (else `merge-<parent>-<leaf>` of the target): see export_label."""
    config = (flow_run.parameters or {}).get("config")
    fields = config if isinstance(config, dict) else vars(config) if config is not None else {}
    return f"merge-{export_label(fields.get('target_dir'), fields.get('local_dir'))}"


def light(value: Any) -> Any:
    """A record (or list of records) for a task argument that Prefect will not walk field by field.

    Prefect visits every nested value of every task argument, on every call, looking for
    futures: for a plan and rank indexes of a model with thousands of tensors that costs
    seconds per call. `opaque` skips the walk but still links the value to its task run.
    """
    return [opaque(v) for v in value] if isinstance(value, list) else opaque(value)


def light_submit(value: Any) -> Any:
    """`light` for `.submit()` arguments, except on Dask, which rebuilds Prefect's (tuple-based)
    annotations as plain tuples: there the records travel bare."""
    context = FlowRunContext.get()
    on_dask = context is not None and type(context.task_runner).__module__.startswith("prefect_dask")
    return value if on_dask else light(value)


def submit_rank_hashes(plan: MergePlan) -> list[PrefectFuture[str]]:
    """One hash task per file of the manifest's source_files (rank files; a DCP's .metadata and .distcp files)."""
    return [hash_rank.submit(light_submit(plan), rank) for rank in range(len(plan.checkpoint.rank_files))]


def rank_digests(plan: MergePlan, futures: list[PrefectFuture[str]]) -> dict[str, str]:
    return {plan.checkpoint.rank_files[rank]: future.result() for rank, future in enumerate(futures)}


def load_layouts(plan: MergePlan, progress: RunProgress) -> dict[str, TensorLayout]:
    """Where every tensor's pieces are, as the checkpoint's source indexes it: each rank file in parallel (verl),
    or the checkpoint's own metadata read once (a DCP's `.metadata`)."""
    if indexed_by_metadata(plan):
        future = index_dcp.submit(light_submit(plan))
        progress.counting(LOADING, [future])
        layouts = future.result()
        get_run_logger().info(indexed_note(plan, len(layouts)))
        return layouts
    rank_futures = [load_rank_shards.submit(light_submit(plan), rank) for rank in range(index_units(plan))]
    progress.counting(LOADING, rank_futures)  # loading ranks k/W
    indexes = [f.result() for f in rank_futures]
    get_run_logger().info(indexed_note(plan, len(indexes)))
    return combine_rank_layouts(light(indexes))


def run_export(plan: MergePlan, allow_unchanged: bool = False,
               smoke: SmokeSettings | None = None) -> tuple[dict[str, str], Manifest]:
    """The steps after inspection, run while the target lock is held (`smoke`: the runtime check before validation)."""
    logger = get_run_logger()
    prepare_staging(plan)
    progress = merge_progress()
    layouts = load_layouts(plan, progress)
    if plan.extract is not None:
        return run_extraction_export(plan, layouts, progress, smoke)
    lora = plan_lora(light(plan), light(layouts)) if plan.lora is not None else None
    hashes: list[PrefectFuture[str]] | None = None
    adapter = None
    if lora is not None and lora.exports_adapter:
        hashes = submit_rank_hashes(plan)  # the adapter's own manifest lists the rank files' digests
        adapter = write_lora_adapter(light(plan), light(lora), light(layouts), rank_digests(plan, hashes))
    if lora is not None and not lora.writes_model:  # a LoRA-only adapter export: lora_adapter/ is the artifact
        manifest = smoke_staged(plan, adapter.manifest, smoke, adapter.shard.file_name)
        progress.begin(VALIDATING)
        report = validate_staged_task(light(plan), light(manifest), light(adapter.verified()))
        return seal_and_publish(plan, report), manifest
    # The tensors to write (an architecture adapter's conversion and the output's key mapping applied), packed
    # into the output's files by its writer: sharded safetensors, or one file.
    output = (plan_lora_writes(light(plan), light(lora), light(layouts)) if lora is not None
              else plan_reconstruction(light(plan), light(layouts)))
    # Pipeline assets are copied while the shards are written.
    copy_future = copy_components.submit(light_submit(plan)) if plan.base.copy_files else None
    artifact = start_progress(plan, output.total_size)
    progress.begin_writing(output)  # bytes written of output.total_size
    futures = [write_shard.submit(light_submit(plan), light_submit(shard)) for shard in output.shards]
    if hashes is None:
        # Queued behind the shard writers: the rank files are hashed on the core they leave idle.
        hashes = submit_rank_hashes(plan)
    records: dict[str, ShardRecord] = {}
    for record in progress.written_shards(futures, artifact):  # the artifact follows the bytes, also when a write fails
        records[record.file_name] = record
    ordered = [records[s.file_name] for s in output.shards]
    logger.info("Wrote %d shard(s), %d tensors, %d bytes", len(ordered), output.tensor_count, output.total_size)
    progress.counting(HASHING, hashes)  # what the writers left of hashing the rank files
    copied = copy_future.result() if copy_future is not None else None
    progress.report_reuse(len(output.shards), copied)  # a rerun: how much of the kept staging it reused
    # Before the manifest and validation: nothing is published if refused. An exported LoRA adapter is the
    # training, so the model beside it is the base by design: not guarded. A fusion's own weights are sampled first.
    unchanged = (guard_unchanged_task(light(plan), light(ordered), allow_unchanged,
                                      lora.fused_weights if lora else frozenset()) if adapter is None else None)
    extra_files = (list(adapter.files) if adapter else []) + (list(copied.files) if copied else [])
    manifest = write_metadata(light(plan), light(output), rank_digests(plan, hashes), light(ordered), extra_files or None,
                              lora.fusion_record() if lora else None, unchanged)
    verified = {plan.output.relative(r.file_name): r.verified() for r in ordered}
    if adapter is not None:
        verified.update(adapter.verified())
    manifest = smoke_staged(plan, manifest, smoke)
    progress.begin(VALIDATING)
    report = validate_staged_task(light(plan), light(manifest), light(verified))
    progress.begin(PUBLISHING)
    return seal_and_publish(plan, report), manifest


def seal_and_publish(plan: MergePlan, report: ValidationReport) -> dict[str, str]:
    """Pin the validated manifest, sign everything when a key is configured, then publish: with a key,
    no unsigned artifact is ever visible."""
    return publish(light(plan), light(report), seal(light(plan), light(report)))


def smoke_staged(plan: MergePlan, manifest: Manifest, smoke: SmokeSettings | None,
                 adapter_file: str | None = None) -> Manifest:
    """--smoke: the runtime check on the staged artifact, its record in the manifest; else the manifest as it is."""
    if smoke is None:
        return manifest
    merge_progress().begin(SMOKING)
    return runtime_check_staged_task(light(plan), light(manifest), smoke, adapter_file)


def run_extraction_export(plan: MergePlan, layouts: dict[str, TensorLayout],
                          progress: RunProgress, smoke: SmokeSettings | None = None) -> tuple[dict[str, str], Manifest]:
    """--extract-lora: the factors of every changed linear, then lora_adapter/ alone is the artifact."""
    hashes = submit_rank_hashes(plan)  # hashed while the SVDs run
    extraction = extract_lora(light(plan), light(layouts))
    summary = extraction.record["summary"]
    get_run_logger().info("Extracted %d layers: energy-weighted retained %.6f, worst %.6f, factors %d bytes (%.4f of the model)",
                          summary["layers"], summary["energy_weighted_retained"], summary["min_retained"],
                          summary["adapter_factor_bytes"], summary["size_ratio"])
    adapter = write_lora_adapter(light(plan), light(extraction.lora), light(layouts), rank_digests(plan, hashes),
                                 light(extraction))
    manifest = smoke_staged(plan, adapter.manifest, smoke, adapter.shard.file_name)
    progress.begin(VALIDATING)
    report = validate_staged_task(light(plan), light(manifest), light(adapter.verified()))
    progress.begin(PUBLISHING)
    return seal_and_publish(plan, report), manifest


@flow(name="mergeflow-merge", flow_run_name=merge_run_name, persist_result=True, validate_parameters=True,
      on_crashed=[name_the_kept_staging])
def merge_flow(config: ModelMergerConfig) -> PublishedMerge:  # its result is the CLI's final JSON line
    """Export an FSDP checkpoint as a verified, atomically published artifact."""
    started = time.monotonic()
    logger = get_run_logger()
    # One line an operator reads first: what is merged onto what, and where it goes.
    logger.info("Merging %s onto base %s -> %s (format %s, dtype %s)", config.local_dir, config.base_model,
                config.target_dir, config.output_format, config.dtype)
    leave = enter_export_session()  # this export's own state: the CLI's session, else this run's
    try:
        with typed_os_errors():  # before the lock (inspection, the lock itself): nothing staged yet
            merge_progress().begin(INSPECTING)
            plan = inspect_inputs(config)
            with target_locked(plan):
                smoke = (SmokeSettings(config.smoke_device, config.smoke_dtype, config.trust_remote_code)
                         if config.smoke else None)
                result, manifest = run_export(plan, config.allow_unchanged, smoke)
    finally:
        leave()  # nothing process-wide to clear: the session goes with the export
    label = export_label(plan.output.target, plan.checkpoint.actor_dir)  # the progress artifact's key too
    count, total = publish_manifest_artifacts(plan, manifest, result["output_dir"], label)
    logger.info("Published %s: %d files, %d bytes in %.1f s", result["output_dir"], count, total,
                time.monotonic() - started)
    if config.hf_upload_path:
        merge_progress().begin(UPLOADING)
        result["upload"] = upload_published(result["output_dir"], config.hf_upload_path, config.private)
    return result


def upload_published(output_dir: str, repo_id: str, private: bool) -> UploadOutcome:
    """Upload after local publication; a failure is reported, never undoes the local artifact."""
    try:
        return {"status": "uploaded", **upload_to_hub(output_dir, repo_id, private)}
    except UploadError as exc:
        get_run_logger().error("Upload to %s failed: %s", repo_id, exc)
        return {"status": "failed", "repo_id": repo_id, "error": str(exc)}
