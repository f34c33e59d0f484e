"""LoRA steps of an export: plan_lora (validate every adapter), the model's tensor plan, the adapter writer.

Plain functions first (tested directly), then their Prefect tasks.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from mergeflow.errors import LoraError
from mergeflow.fsops import sha256_file
from mergeflow.jsonfiles import write_bytes_durable, write_json_durable
from mergeflow.layout import TensorLayout, plan_layouts
from mergeflow.lora_export import adapter_config_json, diffusers_lora_keys, diffusers_lora_metadata, peft_adapter_keys
from mergeflow.lora_keys import base_state_keys, group_adapters, saved_module_overrides, saved_modules, target_modules
from mergeflow.lora_artifact import ADAPTER_DIR
from mergeflow.lora_config import peft_adapter_config
from mergeflow.lora_plan import FULL_STATE, LoraPlan, LoraSpec, default_scaling, validate_all_adapters
from mergeflow.manifest import MANIFEST_NAME, fingerprint
from mergeflow.records import FileRecord, MergePlan, RankIndex, ShardPlan, ShardRecord, TensorWrite
from mergeflow.safetensors_format import nbytes
from mergeflow.tasks.common import RETRY_IO
from mergeflow.lora_fuse import BASE_COPY, LORA_FUSE, base_model_source, checkpoint_source
from mergeflow.export.reconstruct import RankStates, check_coverage, output_dtype
from mergeflow.export.shard_writer import HEADER_METADATA, write_shard_file

ADAPTER_CONFIG_FILE = "adapter_config.json"

__all__ = ["AdapterExport", "adapter_dir", "lora_tensor_writes", "plan_lora", "plan_lora_export",
           "plan_lora_writes", "write_adapter", "write_lora_adapter"]


def _layouts(indexes: list[RankIndex]) -> dict[str, TensorLayout]:
    return plan_layouts([ix.entries for ix in sorted(indexes, key=lambda ix: ix.rank)])


def plan_lora_export(plan: MergePlan, indexes: list[RankIndex]) -> LoraPlan:
    """Validate every adapter of the checkpoint against the model and fix what is fused or exported."""
    if plan.lora is None:
        raise LoraError("plan_lora called for a checkpoint without LoRA")
    spec = LoraSpec.from_dict(plan.lora)
    layouts = _layouts(indexes)
    keys = list(layouts)
    shapes = {key: layout.shape for key, layout in layouts.items()}
    grouped = group_adapters(keys)
    settings = spec.adapter_settings()
    chosen = validate_all_adapters(
        grouped, shapes, plan.expected_shapes, settings,
        selected=spec.adapter_name, fuse=spec.fuse, layout=spec.layout,
    )
    selected = grouped[spec.adapter_name]
    saved = saved_modules(keys).get(spec.adapter_name, {})
    adapter_keys: dict[str, str] = {}
    config: dict[str, Any] | None = None
    if not spec.fuse:
        config = peft_adapter_config(settings, target_modules(selected), spec.base_model_name_or_path, saved or None)
        if spec.adapter_format == "diffusers":
            if saved:
                raise LoraError(f"adapter {spec.adapter_name!r} has modules_to_save ({', '.join(sorted(saved))}), "
                                "which Diffusers' LoRA format cannot carry; export it in PEFT format")
            adapter_keys = diffusers_lora_keys(selected)
        else:
            adapter_keys = peft_adapter_keys(selected, saved)
    overrides = saved_module_overrides(keys, spec.adapter_name) if spec.fuse and spec.layout == FULL_STATE else {}
    return LoraPlan(
        adapter_name=spec.adapter_name,
        excluded_adapters=tuple(sorted(set(grouped) - {spec.adapter_name})),
        layout=spec.layout,
        fuse=spec.fuse,
        adapter_format=spec.adapter_format,
        base_weights=spec.base_weights,
        r=settings.r,
        lora_alpha=settings.lora_alpha,
        scaling=default_scaling(settings),
        settings_origin=spec.settings_origin,
        modules=tuple(chosen),
        saved_overrides=overrides,
        adapter_keys=adapter_keys,
        adapter_config=config,
    )


def _fusion_transforms(lora: LoraPlan, source: Any) -> dict[str, dict[str, Any]]:
    """Output tensor name -> lora_fuse transform, for the fused weight (and bias) of every module."""
    transforms: dict[str, dict[str, Any]] = {}
    for module in lora.modules:
        parts = {kind: source(key) for kind, key in module.sources.items()}
        common = {"op": LORA_FUSE, "module": module.module, "scaling": module.scaling, "rank": module.rank}
        transforms[f"{module.module}.weight"] = {
            **common, "param": "weight", "lora_A": parts["lora_A"], "lora_B": parts["lora_B"],
            "lora_magnitude_vector": parts.get("lora_magnitude_vector"), "lora_B_bias": None,
        }
        if "lora_B_bias" in parts:
            transforms[f"{module.module}.bias"] = {
                **common, "param": "bias", "lora_A": None, "lora_B": None,
                "lora_magnitude_vector": None, "lora_B_bias": parts["lora_B_bias"],
            }
    return transforms


def lora_tensor_writes(plan: MergePlan, lora: LoraPlan, indexes: list[RankIndex]) -> list[TensorWrite]:
    """The model's tensors: frozen weights with adapters stripped, fused where --fuse-lora asks."""
    spec = LoraSpec.from_dict(plan.lora or {})
    layouts = _layouts(indexes)
    policy, keep = plan.config["dtype"], plan.keep_fp32

    def checkpoint(key: str) -> dict[str, Any]:
        return checkpoint_source(layouts[key])

    transforms = _fusion_transforms(lora, checkpoint) if lora.fuse else {}
    writes = []
    if lora.layout == FULL_STATE:
        mapping = base_state_keys(layouts)
        mapping.update(lora.saved_overrides)  # modules_to_save copies replace their modules when fusing
        check_coverage(plan.expected_shapes, {name: layouts[src].shape for name, src in mapping.items()})
        for name, src in sorted(mapping.items()):
            layout = layouts[src]
            out = output_dtype(name, layout.dtype, policy, keep)
            transform = transforms.get(name)
            if transform is not None:
                transform = {**transform, "base": checkpoint_source(layout)}
            writes.append(TensorWrite(name, src, layout, out, transform))
        return writes
    # LoRA-only fusion: every frozen weight comes from the local base's safetensors files.
    from mergeflow.schema import base_weight_headers

    component = Path(plan.base_component_dir)
    headers = base_weight_headers(component, weights_name=plan.weights_name)
    unknown = sorted(set(transforms) - set(headers))
    if unknown:  # never a silent copy of an unfused weight
        raise LoraError(f"the base model has no tensor {unknown[0]} to fuse the adapter into")
    for name, (dtype, shape) in sorted(headers.items()):
        layout = TensorLayout(f"base_model:{name}", dtype, tuple(shape), None, (), (tuple(shape),))
        base = base_model_source(component / spec.base_weight_map[name], name)
        transform = {**transforms[name], "base": base} if name in transforms else {"op": BASE_COPY, "base": base}
        writes.append(TensorWrite(name, name, layout, output_dtype(name, dtype, policy, keep), transform))
    return writes


def adapter_dir(plan: MergePlan) -> Path:
    """Where the exported adapter is staged: `<artifact>/lora_adapter/`."""
    return Path(plan.artifact_dir) / ADAPTER_DIR


@dataclass(frozen=True)
class AdapterExport:
    """A written, verified adapter directory: its files (relative to the artifact root) and manifest."""

    files: tuple[FileRecord, ...]
    manifest: dict[str, Any]
    shard: ShardRecord


def _adapter_shard(plan: MergePlan, lora: LoraPlan, indexes: list[RankIndex]) -> ShardPlan:
    layouts = _layouts(indexes)
    policy, keep = plan.config["dtype"], plan.keep_fp32
    writes = tuple(
        TensorWrite(out, src, layouts[src], output_dtype(out, layouts[src].dtype, policy, keep))
        for out, src in sorted(lora.adapter_keys.items())
    )
    metadata = dict(HEADER_METADATA)
    if lora.adapter_format == "diffusers":
        metadata = diffusers_lora_metadata(lora.adapter_config or {})
    from mergeflow.lora_inspect import adapter_weights_name

    name = adapter_weights_name(lora.adapter_format)
    body = [asdict(tw) for tw in writes]
    return ShardPlan(
        index=0,
        file_name=name,
        tensors=writes,
        nbytes=sum(nbytes(t.out_dtype, t.layout.shape) for t in writes),
        fingerprint=fingerprint([plan.fingerprint, ADAPTER_DIR, name, body, metadata, "adapter-v1"]),
        metadata=metadata,
    )


def _adapter_manifest(plan: MergePlan, lora: LoraPlan, rank_digests: dict[str, str], shard: ShardRecord,
                      files: list[FileRecord]) -> dict[str, Any]:
    from mergeflow.tasks.publish import build_manifest

    spec = LoraSpec.from_dict(plan.lora or {})
    # The adapter directory is an artifact of its own: tensors at its root, its own file list.
    own = replace(plan, artifact_type="peft_adapter", tensor_directory=".")
    manifest = build_manifest(own, rank_digests, [shard], files, {"removed_keys": {}})
    manifest["lora_adapter"] = {
        "adapter_name": lora.adapter_name,
        "format": lora.adapter_format,
        "base_model_name_or_path": spec.base_model_name_or_path,
        "layout": lora.layout,
        "r": lora.r,
        "lora_alpha": lora.lora_alpha,
        "target_modules": sorted((lora.adapter_config or {}).get("target_modules") or []),
        "excluded_adapters": list(lora.excluded_adapters),
        "settings_source": lora.settings_origin,
    }
    return manifest


def write_adapter(plan: MergePlan, lora: LoraPlan, indexes: list[RankIndex], rank_digests: dict[str, str]) -> AdapterExport:
    """Write `lora_adapter/`: weights (streamed, round-trip verified), adapter_config.json, its manifest."""
    out_dir = adapter_dir(plan)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(plan.work_dir) / ADAPTER_DIR
    work.mkdir(parents=True, exist_ok=True)
    states = RankStates(Path(plan.actor_dir), plan.rank_files, trust_checkpoint=bool(plan.config.get("trust_checkpoint")))
    shard = _adapter_shard(plan, lora, indexes)
    record = write_shard_file(shard, states, out_dir, work)
    files: list[FileRecord] = []
    if lora.adapter_format == "peft":
        raw = (adapter_config_json(lora.adapter_config or {}) + "\n").encode("utf-8")
        write_bytes_durable(out_dir / ADAPTER_CONFIG_FILE, raw)
        files.append(FileRecord(ADAPTER_CONFIG_FILE, sha256_file(out_dir / ADAPTER_CONFIG_FILE), len(raw), "written"))
    manifest = _adapter_manifest(plan, lora, rank_digests, record, files)
    data = write_json_durable(out_dir / MANIFEST_NAME, manifest, indent=2)
    listed = [(record.file_name, record.sha256, record.size)] + [(f.rel_path, f.sha256, f.size) for f in files]
    listed.append((MANIFEST_NAME, sha256_file(out_dir / MANIFEST_NAME), len(data)))
    rooted = tuple(FileRecord(f"{ADAPTER_DIR}/{name}", digest, size, "written") for name, digest, size in listed)
    return AdapterExport(files=rooted, manifest=manifest, shard=record)


@task(name="plan-lora", task_run_name="plan-lora", cache_policy=NO_CACHE)
def plan_lora(plan: MergePlan, indexes: list[RankIndex]) -> LoraPlan:
    """Validate every LoRA adapter (pairs, ranks, shapes, targets) and record what is fused or exported."""
    return plan_lora_export(plan, indexes)


@task(name="plan-lora-writes", task_run_name="plan-lora-writes", cache_policy=NO_CACHE)
def plan_lora_writes(plan: MergePlan, lora: LoraPlan, indexes: list[RankIndex]) -> list[TensorWrite]:
    """Plan the model's tensors of a LoRA export: base weights, fused where asked, checked against the base."""
    return lora_tensor_writes(plan, lora, indexes)


@task(name="write-lora-adapter", task_run_name="write-lora-adapter", **RETRY_IO, cache_policy=NO_CACHE)
def write_lora_adapter(plan: MergePlan, lora: LoraPlan, indexes: list[RankIndex],
                       rank_digests: dict[str, str]) -> AdapterExport:
    """Stream the selected adapter into lora_adapter/ with its PEFT (or Diffusers) config and manifest."""
    return write_adapter(plan, lora, indexes, rank_digests)
