"""Inspecting the inputs before any heavy work: flags, paths, checkpoint shape, base schema."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from mergeflow.architectures import detect_base
from mergeflow.checkpoint import FSDP_CONFIG, LORA_META, read_fsdp_config, rank_file_names
from mergeflow.config import ModelMergerConfig
from mergeflow.errors import CheckpointError
from mergeflow.fsops import FileStamp, sha256_file
from mergeflow.manifest import fingerprint
from mergeflow.prefetch import DigestPrefetch
from mergeflow.paths import lock_path_for, staging_dir_for
from mergeflow.preflight import check_output_format, resolve_inputs
from mergeflow.records import MergePlan
from mergeflow.schema import read_model_config
from mergeflow.lora_inspect import detect_lora, finish_lora_spec, inspect_adapter_export
from mergeflow.export.targets import pipeline_target, transformer_target


def inspect_merge(config: ModelMergerConfig) -> MergePlan:
    """Decide everything about an export from metadata alone, refusing bad input early."""
    config.validate()
    lora = detect_lora(config)  # None without LoRA; LoRA faults are refused here, before any output
    if lora is not None and lora.adapter_only:
        return inspect_adapter_export(config, lora)  # a LoRA-only adapter needs no local base
    paths = resolve_inputs(config)
    actor, base, target = paths["actor"], paths["base"], paths["target"]
    fsdp = read_fsdp_config(actor)
    rank_files = rank_file_names(actor, fsdp.world_size)
    # The manifest's rank-file digests: hashed on the idle core while the schema is built.
    DigestPrefetch.start([actor / name for name in rank_files])
    layout = detect_base(base, config.component)
    check_output_format(config, layout)
    actor_config_path = paths["config_dir"] / "config.json"
    actor_config = read_model_config(actor_config_path, CheckpointError, "huggingface/config.json of the checkpoint")
    if config.output_format == "pipeline":
        out = pipeline_target(config, base, actor_config)
    else:
        out = transformer_target(base, layout, actor_config)
    component_dir = out.component_dir
    inputs = [actor / FSDP_CONFIG, actor_config_path] + [actor / n for n in rank_files]
    stamps = {str(p): FileStamp.of(p) for p in inputs}
    stamps.update(out.base_stamps)
    base_files = dict(out.base_files)
    lora_inputs = finish_lora_spec(lora, config, base, layout, component_dir, out.weights_name) if lora else None
    if lora_inputs is not None:
        stamps.update(lora_inputs.stamps)
        base_files.update(lora_inputs.base_files)
    options = {k: v for k, v in config.to_dict().items() if k not in ("workers", "hf_upload_path", "private")}
    fp = fingerprint([options, {k: list(v.__dict__.values()) for k, v in stamps.items()}, str(target)])
    staging = staging_dir_for(target, fp)
    return MergePlan(
        config=config.to_dict(),
        actor_dir=str(actor),
        config_dir=str(paths["config_dir"]),
        base_dir=str(base),
        target=str(target),
        staging=str(staging),
        lock=str(lock_path_for(target)),
        world_size=fsdp.world_size,
        fsdp_version=fsdp.version,
        rank_files=tuple(rank_files),
        base_kind=layout.kind,
        architecture=out.architecture,
        transformer_class=out.transformer_class,
        component=config.component,
        base_component_dir=str(component_dir),
        tensor_directory=out.tensor_directory,
        artifact_type=out.artifact_type,
        weights_name=out.weights_name,
        expected_shapes=out.expected_shapes,
        keep_fp32=out.keep_fp32,
        input_stamps=stamps,
        source_config_sha256=sha256_file(actor_config_path),
        base_files=base_files,
        fingerprint=fp,
        lora=lora_inputs.spec if lora_inputs is not None else None,
        extras=out.extras,
        copy_files=out.copy_files,
    )


@task(name="inspect", task_run_name="inspect-inputs", cache_policy=NO_CACHE)
def inspect_inputs(config: ModelMergerConfig) -> MergePlan:
    """Check flags, paths, checkpoint files and the base schema; plan the export."""
    return inspect_merge(config)


def describe_checkpoint(actor_dir: Path, *, trust_checkpoint: bool = False) -> dict[str, Any]:
    """What is this checkpoint? World size, layout, tensors, dtypes, LoRA adapters, class."""
    from mergeflow.layout import plan_layouts
    from mergeflow.rank_files import describe_state, load_rank_state

    actor_dir = actor_dir.expanduser().resolve()
    fsdp = read_fsdp_config(actor_dir)
    names = rank_file_names(actor_dir, fsdp.world_size)
    entries = [describe_state(load_rank_state(actor_dir / n, trust_checkpoint=trust_checkpoint), n) for n in names]
    layouts = plan_layouts(entries)
    from mergeflow.safetensors_format import nbytes

    placements = {e.placements for e in entries[0].values()}
    if all(not p for p in placements):
        kind = "plain"
    elif any(len(p) == 2 for p in placements):
        kind = "HSDP"
    else:
        kind = f"FSDP{fsdp.version}"
    dtypes: dict[str, int] = {}
    for layout in layouts.values():
        dtypes[layout.dtype] = dtypes.get(layout.dtype, 0) + 1
    adapters = sorted({part for key in layouts for part in _adapter_names(key)})
    config_path = actor_dir / "huggingface" / "config.json"
    class_name = None
    if config_path.is_file():
        class_name = read_model_config(config_path, CheckpointError, "huggingface/config.json").get("_class_name")
    return {
        "world_size": fsdp.world_size,
        "fsdp_version": fsdp.version,
        "layout": kind,
        "tensors": len(layouts),
        "bytes": sum(nbytes(l.dtype, l.shape) for l in layouts.values()),
        "dtypes": dtypes,
        "lora_adapters": adapters,
        "lora_meta": (actor_dir / LORA_META).is_file(),
        "class_name": class_name,
    }


def _adapter_names(key: str) -> list[str]:
    parts = key.split(".")
    return [parts[i + 1] for i, p in enumerate(parts[:-1]) if p in ("lora_A", "lora_B") and i + 2 < len(parts)]
