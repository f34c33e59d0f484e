"""Inspecting a LoRA checkpoint: detection, layout, settings, and the plan of an adapter-only export.

Called from `inspect` before any heavy work; everything here reads metadata and key names only.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from mergeflow.architectures.registry import BaseLayout, adapter_of, base_layout
from mergeflow.architectures.schema import model_schema, read_model_config
from mergeflow.config import DEFAULT_ADAPTER_FORMAT, ModelMergerConfig
from mergeflow.errors import BaseModelError, CheckpointError, LoraError, UsageError
from mergeflow.export.plan.targets import TargetSchema, diffusers_schema
from mergeflow.formats.model_config import ModelConfig
from mergeflow.formats.verl_checkpoint import LORA_META
from mergeflow.formats.weight_index import read_weight_map
from mergeflow.io.fs import FileStamp
from mergeflow.io.jsonfiles import read_json_strict
from mergeflow.io.paths import check_no_overlap
from mergeflow.io.session import current_session, sha256_file
from mergeflow.io.staging import check_target
from mergeflow.lora.config import (
    ADAPTER_CONFIG_NAME,
    AdapterSettings,
    LoraTrainMeta,
    load_adapter_settings,
    load_train_meta,
)
from mergeflow.lora.keys import LoraLayout, classify, group_adapters, require_adapter
from mergeflow.lora.plan import FULL_STATE, LORA_ONLY, LoraSpec, base_model_reference
from mergeflow.outputs.registry import adapter_output
from mergeflow.records import BaseInputs
from mergeflow.sources.base import OpenedCheckpoint


def adapter_weights_name(adapter_format: str) -> str:
    """The weight file of an exported adapter in the chosen format."""
    return adapter_output(adapter_format).weights_name


QUANTIZE_NEEDS_MODEL = ("--quantize needs a full model (a full checkpoint, or a LoRA one with --fuse-lora): "
                        "a LoRA checkpoint is exported as an adapter, which is never quantized")


def refuse_quantized_adapter(config: ModelMergerConfig) -> None:
    """A LoRA checkpoint without --fuse-lora exports its adapter: --quantize has nothing to quantize."""
    if config.quantize != "none" and not config.fuse_lora:
        raise UsageError(QUANTIZE_NEEDS_MODEL)


def _refuse_lora_flags(config: ModelMergerConfig) -> None:
    if config.fuse_lora:
        raise UsageError("--fuse-lora needs a LoRA checkpoint, but this one has no LoRA adapters "
                         "(no 'lora_' keys, no lora_train_meta.json); drop --fuse-lora")
    used = config.lora_flags()
    if used:
        raise UsageError(f"{used[0]} is for LoRA checkpoints, but this one has no LoRA adapters; drop {used[0]}")


def _adapter_config_file(config: ModelMergerConfig, actor: Path) -> tuple[Path | None, str]:
    """The PEFT adapter_config.json to use (flag first, else beside the checkpoint) and its origin."""
    if config.adapter_config:
        path = Path(config.adapter_config).expanduser()
        if not path.is_file():
            raise UsageError(f"--adapter-config {config.adapter_config} is not a file")
        return path.resolve(), "--adapter-config"
    cfg_dir = Path(config.hf_model_config_path or actor / "huggingface").expanduser().resolve()
    found = [p for p in (actor / ADAPTER_CONFIG_NAME, cfg_dir / ADAPTER_CONFIG_NAME) if p.is_file()]
    if len(found) == 2 and current_session().read_bytes(found[0]) != current_session().read_bytes(found[1]):
        raise LoraError(f"two different {ADAPTER_CONFIG_NAME} files lie beside the checkpoint (in actor/ and "
                        f"{cfg_dir.name}/); remove the stale one or pass --adapter-config PATH")
    if not found:
        return None, LORA_META
    return found[0], _relative_or_name(found[0], actor)


def _relative_or_name(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:
        return path.name


def _settings(config: ModelMergerConfig, actor: Path, meta: LoraTrainMeta | None) -> tuple[AdapterSettings, str, Path | None]:
    path, origin = _adapter_config_file(config, actor)
    if path is None:
        assert meta is not None  # detect_lora refuses a LoRA checkpoint that has neither
        return AdapterSettings.from_meta(meta), origin, None
    settings = load_adapter_settings(path)
    if meta is not None and (settings.r, settings.lora_alpha) != (meta.r, meta.lora_alpha):
        raise LoraError(
            f"{origin} says r={settings.r}, lora_alpha={settings.lora_alpha} but {LORA_META} says r={meta.r}, "
            f"lora_alpha={meta.lora_alpha}; they describe different trainings"
        )
    return settings, origin, path


def detect_lora(config: ModelMergerConfig, checkpoint: OpenedCheckpoint) -> LoraSpec | None:
    """Find LoRA in a checkpoint (its keys + lora_train_meta.json); None when there is none.

    verl writes lora_train_meta.json beside every LoRA run's rank files. A DCP (accelerate and
    others) has none: there the PEFT adapter_config.json (--adapter-config, or beside the checkpoint)
    gives r and lora_alpha.
    """
    actor = checkpoint.directory
    keys = list(checkpoint.keys)
    layout = classify(keys)
    has_meta = (actor / LORA_META).is_file()
    if layout is LoraLayout.NONE and not has_meta:
        _refuse_lora_flags(config)
        return None
    if layout is LoraLayout.NONE:
        raise LoraError(f"{LORA_META} says this is a LoRA run, but the rank files hold no LoRA keys ('lora_' in "
                        "the name); the rank files or the metadata belong to another run")
    if not has_meta and checkpoint.source.requires_lora_meta:
        raise LoraError(f"the rank files hold LoRA adapters but {LORA_META} is missing, so r and lora_alpha are "
                        "unknown; copy it from the training run's actor directory")
    if not has_meta and _adapter_config_file(config, actor)[0] is None:
        raise LoraError(f"the DCP checkpoint holds LoRA adapters but no {LORA_META} or {ADAPTER_CONFIG_NAME} says "
                        "their r and lora_alpha; pass --adapter-config PATH (the PEFT adapter_config.json the run saved)")
    meta = load_train_meta(actor / LORA_META) if has_meta else None
    grouped = group_adapters(keys)
    require_adapter(grouped, config.adapter_name)
    if config.fuse_lora and config.adapter_format != DEFAULT_ADAPTER_FORMAT:  # the flag given
        raise UsageError("--adapter-format chooses how an adapter is exported; with --fuse-lora no adapter is written")
    refuse_quantized_adapter(config)
    settings, origin, path = _settings(config, actor, meta)
    source_files = {LORA_META: sha256_file(actor / LORA_META)} if has_meta else {}
    config_sha = None
    if path is not None:
        config_sha = sha256_file(path)
        if origin != "--adapter-config":
            source_files[origin] = config_sha
    return LoraSpec.create(
        layout=LORA_ONLY if layout is LoraLayout.LORA_ONLY else FULL_STATE,
        fuse=config.fuse_lora,
        adapter_name=config.adapter_name,
        adapter_format=config.adapter_format,
        adapters=list(grouped),
        meta=meta,
        settings=settings,
        settings_origin=origin,
        source_files=source_files,
        adapter_config_sha256=config_sha,
    )


def lora_input_files(config: ModelMergerConfig, actor: Path) -> list[Path]:
    """LoRA inputs that must not change during the export (metadata, adapter config)."""
    files = [actor / LORA_META] if (actor / LORA_META).is_file() else []  # a DCP's LoRA has no metadata file
    path, _ = _adapter_config_file(config, actor)
    return files + ([path] if path is not None else [])


def _recorded_name(base: Path, layout: BaseLayout) -> object:
    root_config = base / ("model_index.json" if layout.kind == "pipeline" else "config.json")
    data = read_json_strict(root_config, BaseModelError, f"{root_config.name} of the base")
    return data.get("_name_or_path") if isinstance(data, dict) else None


def _refuse_unfit_base(layout: BaseLayout, spec: LoraSpec) -> None:
    """A base whose architecture converts the trained tensors may refuse some LoRA exports (its adapter says)."""
    adapter_of(layout).check_lora(spec.layout, spec.fuse)


@dataclass(frozen=True)
class LoraInputs:
    """What the LoRA part adds to a MergePlan: the spec, input stamps and base files read."""

    spec: LoraSpec
    stamps: dict[str, FileStamp]
    base_files: dict[str, str]


def finish_lora_spec(
    spec: LoraSpec, config: ModelMergerConfig, base: Path, layout: BaseLayout, component_dir: Path, weights_name: str
) -> LoraInputs:
    """Complete the spec once the local base is known: adapter base name, and base weights for LoRA-only fusion."""
    actor = Path(config.local_dir or "").expanduser().resolve()
    _refuse_unfit_base(layout, spec)
    stamps = {str(p): FileStamp.of(p) for p in lora_input_files(config, actor)}
    base_files: dict[str, str] = {}
    weight_map: dict[str, str] = {}
    if spec.fuse and spec.layout == LORA_ONLY:
        weight_map = read_weight_map(component_dir, weights_name, BaseModelError, "the base")
        for file_name in sorted(set(weight_map.values())):
            path = component_dir / file_name
            stamps[str(path)] = FileStamp.of(path)
            base_files[path.relative_to(base).as_posix()] = sha256_file(path)
    reference = base_model_reference(config.base_model or "", base.name, _recorded_name(base, layout))
    done = replace(spec, base_model_name_or_path=reference, base_weight_map=weight_map)
    return LoraInputs(done, stamps, base_files)


def resolve_adapter_inputs(config: ModelMergerConfig) -> dict[str, Path]:
    """The paths of an adapter export, checked: the base is optional (a Hub name is fine)."""
    actor = Path(config.local_dir or "").expanduser().resolve()
    cfg_dir = Path(config.hf_model_config_path or actor / "huggingface").expanduser().resolve()
    target = check_target(Path(config.target_dir or ""))
    check_no_overlap({"--local_dir": actor, "--target_dir": target})
    check_no_overlap({"--hf_model_config_path": cfg_dir, "--target_dir": target})
    paths = {"actor": actor, "config_dir": cfg_dir, "target": target}
    base_arg = Path(config.base_model or "").expanduser()
    if base_arg.is_dir():
        paths["base"] = base_arg.resolve()
        check_no_overlap({"--local_dir": actor, "--base_model": paths["base"], "--target_dir": target})
    return paths


def adapter_target(config: ModelMergerConfig, spec: LoraSpec, base: Path | None,
                   actor_config: ModelConfig) -> tuple[TargetSchema, BaseInputs, LoraSpec]:
    """What a LoRA-only save's adapter export writes, with the base it names (checked when local)."""
    base_files: dict[str, str] = {}
    if base is not None:
        layout = base_layout(base, config.component)
        _refuse_unfit_base(layout, spec)
        base_config_path = layout.transformer_dir / "config.json"
        base_config = read_model_config(base_config_path, BaseModelError, f"{base_config_path.relative_to(base)} of the base")
        schema = diffusers_schema(actor_config, base_config)
        base_files[base_config_path.relative_to(base).as_posix()] = sha256_file(base_config_path)
        reference = base_model_reference(config.base_model or "", base.name, _recorded_name(base, layout))
        base_inputs = BaseInputs(base_dir=str(base), kind=layout.kind, component_dir=str(layout.transformer_dir),  # type: ignore[arg-type]
                                 files=base_files)
    else:
        reference = base_model_reference(config.base_model or "", None, None)
        class_name = actor_config.get("_class_name")
        if not isinstance(class_name, str):
            raise CheckpointError("huggingface/config.json of the checkpoint has no _class_name")
        schema = model_schema(class_name, actor_config)
        base_inputs = BaseInputs(base_dir="", kind="hub", component_dir="", files=base_files)
    target = TargetSchema(
        architecture=schema.class_name, transformer_class=schema.class_name, component_dir=Path(base_inputs.component_dir),
        tensor_directory=".", artifact_type=adapter_output(spec.adapter_format).artifact_types[0],
        weights_name=adapter_weights_name(spec.adapter_format), expected_shapes=schema.tensors, keep_fp32=schema.keep_fp32,
        base_files=base_files, base_stamps={}, output=adapter_output(spec.adapter_format).name,
    )
    return target, base_inputs, replace(spec, base_model_name_or_path=reference)
