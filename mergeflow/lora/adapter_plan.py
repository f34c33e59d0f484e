"""The LoRA side of an export: validate every adapter (-> LoraPlan) and plan the model's tensors."""


from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from mergeflow.errors import BaseModelError, LoraError
from mergeflow.export.reconstruct.rebuild import check_coverage, output_dtype
from mergeflow.formats.weight_index import read_weight_headers
from mergeflow.lora.config import AdapterConfig, peft_adapter_config
from mergeflow.lora.keys import (
    base_state_keys,
    group_adapters,
    saved_module_overrides,
    saved_modules,
    target_modules,
)
from mergeflow.lora.plan import (
    FULL_STATE,
    LoraPlan,
    default_scaling,
    validate_all_adapters,
)
from mergeflow.outputs.registry import adapter_output
from mergeflow.records import (
    BaseCopy,
    BaseModelSource,
    CheckpointSource,
    LoraFuse,
    MergePlan,
    TensorLayout,
    TensorWrite,
    Transform,
)


def plan_lora_export(plan: MergePlan, layouts: dict[str, TensorLayout]) -> LoraPlan:
    """Validate every adapter of the checkpoint against the model and fix what is fused or exported."""
    if plan.lora is None:
        raise LoraError("plan_lora called for a checkpoint without LoRA")
    spec = plan.lora
    keys = list(layouts)
    shapes = {key: layout.shape for key, layout in layouts.items()}
    grouped = group_adapters(keys)
    settings = spec.settings
    chosen = validate_all_adapters(
        grouped, shapes, plan.output.expected_shapes, settings,
        selected=spec.adapter_name, fuse=spec.fuse, layout=spec.layout,
    )
    selected = grouped[spec.adapter_name]
    saved = saved_modules(keys).get(spec.adapter_name, {})
    adapter_keys: dict[str, str] = {}
    config: AdapterConfig | None = None
    if not spec.fuse:
        config = peft_adapter_config(settings, target_modules(selected), spec.base_model_name_or_path, saved or None)
        adapter_keys = adapter_output(spec.adapter_format).adapter_keys(spec.adapter_name, selected, saved)
    overrides = saved_module_overrides(keys, spec.adapter_name) if spec.fuse and spec.layout == FULL_STATE else {}
    lora = LoraPlan(
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
    if not spec.fuse:  # planned now so that a layout's refusal comes before any write
        adapter_output(spec.adapter_format).adapter_writes(plan, lora, layouts)
    return lora


def _fusion_transforms(lora: LoraPlan, layouts: dict[str, TensorLayout]) -> dict[str, LoraFuse]:
    """Output tensor name -> its fusion, for the fused weight (and bias) of every module (base set later)."""
    transforms: dict[str, LoraFuse] = {}
    for module in lora.modules:
        parts = {kind: CheckpointSource(layouts[key]) for kind, key in module.sources.items()}
        transforms[f"{module.module}.weight"] = LoraFuse(
            "weight", module.module, module.scaling, module.rank, lora_A=parts["lora_A"], lora_B=parts["lora_B"],
            lora_magnitude_vector=parts.get("lora_magnitude_vector"),
        )
        if "lora_B_bias" in parts:
            transforms[f"{module.module}.bias"] = LoraFuse(
                "bias", module.module, module.scaling, module.rank, lora_B_bias=parts["lora_B_bias"],
            )
    return transforms


def lora_tensor_writes(plan: MergePlan, lora: LoraPlan, layouts: dict[str, TensorLayout]) -> list[TensorWrite]:
    """The model's tensors: frozen weights with adapters stripped, fused where --fuse-lora asks."""
    spec = plan.lora
    policy, keep = plan.options.dtype, plan.output.keep_fp32

    transforms = _fusion_transforms(lora, layouts) if lora.fuse else {}
    writes = []
    if lora.layout == FULL_STATE:
        mapping = base_state_keys(layouts)
        mapping.update(lora.saved_overrides)  # modules_to_save copies replace their modules when fusing
        check_coverage(plan.output.expected_shapes, {name: layouts[src].shape for name, src in mapping.items()})
        for name, src in sorted(mapping.items()):
            layout = layouts[src]
            out = output_dtype(name, layout.dtype, policy, keep)
            fusion = transforms.get(name)
            transform = replace(fusion, base=CheckpointSource(layout)) if fusion is not None else None
            writes.append(TensorWrite(name, src, layout, out, transform))
        return writes
    # LoRA-only fusion: every frozen weight comes from the local base's safetensors files.
    component = Path(plan.base.component_dir)
    headers = read_weight_headers(component, plan.output.base_weights_name, BaseModelError, "the base")
    unknown = sorted(set(transforms) - set(headers))
    if unknown:  # never a silent copy of an unfused weight
        raise LoraError(f"the base model has no tensor {unknown[0]} to fuse the adapter into")
    for name, (dtype, shape) in sorted(headers.items()):
        layout = TensorLayout(f"base_model:{name}", dtype, tuple(shape), None, (), (tuple(shape),))
        base = BaseModelSource(str(component / spec.base_weight_map[name]), name)
        transform: Transform = replace(transforms[name], base=base) if name in transforms else BaseCopy(base)
        writes.append(TensorWrite(name, name, layout, output_dtype(name, dtype, policy, keep), transform))
    return writes
