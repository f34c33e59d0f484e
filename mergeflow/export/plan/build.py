"""Planning an export from metadata alone: flags, paths, checkpoint shape, base schema -> MergePlan.

`build_plan` is the one place a `MergePlan` is made. A model export (pipeline or transformer,
LoRA fused or not) and a LoRA-only adapter export differ in how they find their base and
target schema; everything else (the checkpoint's files, the input stamps, the fingerprint that
names the staging directory) is decided here once for both.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from mergeflow.architectures.registry import base_layout
from mergeflow.architectures.schema import (
    TensorBudget,
    read_model_config,
    tensor_budget,
)
from mergeflow.config import ModelMergerConfig
from mergeflow.errors import BaseModelError, LoraError, MergeflowError, UsageError
from mergeflow.export.plan.input_checks import check_output_format, resolve_inputs
from mergeflow.export.plan.preflight import preflight_merge
from mergeflow.export.plan.targets import TargetSchema
from mergeflow.formats.manifest import fingerprint
from mergeflow.formats.model_config import ModelConfig
from mergeflow.formats.weight_index import read_weight_map
from mergeflow.hub.model_card import base_model_id
from mergeflow.io.fs import FileStamp
from mergeflow.io.paths import lock_path_for, resolved_path_options, staging_dir_for
from mergeflow.io.session import sha256_file
from mergeflow.lora.detect import (
    _recorded_name,
    adapter_target,
    detect_lora,
    finish_lora_spec,
    lora_input_files,
    resolve_adapter_inputs,
)
from mergeflow.lora.extract_spec import ExtractSpec
from mergeflow.lora.plan import LoraSpec, base_model_reference
from mergeflow.outputs.registry import adapter_output, model_output
from mergeflow.records import (
    BaseInputs,
    CheckpointInputs,
    ExportOptions,
    MergePlan,
    OutputTarget,
)
from mergeflow.sources.base import ModelConfigSource
from mergeflow.sources.registry import (
    model_config_source,
    open_checkpoint,
)

# Options that do not change a byte of the artifact stay out of the fingerprint, so changing
# them keeps a half-done export resumable.
# The signing key too: the signature is added after validation, at every run (mergeflow/export/publish.py).
_NOT_FINGERPRINTED = ("workers", "hf_upload_path", "private", "allow_unchanged", "sign_key", "smoke", "smoke_device",
                      "smoke_dtype")


@dataclass(frozen=True)
class _Decided:
    """What one kind of export decided about its base and target, before the staging name."""

    schema: TargetSchema
    base: BaseInputs
    lora: LoraSpec | None
    stamps: dict[str, FileStamp]
    extract: ExtractSpec | None = None


def build_plan(config: ModelMergerConfig) -> MergePlan:
    """Decide everything about an export from metadata alone, refusing bad input early."""
    # Stage 1, the pre-flight: flags, paths, links, listings, small JSON, the base's layout and classes.
    # The command line's answer when it ran it in this export; here otherwise (a served run). Its files
    # (the manifest's source-file digests) are hashed on the idle core from then on.
    preflight_merge(config)
    # Stage 2: the checkpoint's own metadata (verl's rank 0, or a DCP's .metadata) and the schema.
    actor = Path(config.local_dir or "").expanduser().resolve()
    checkpoint = open_checkpoint(actor, trust_checkpoint=config.trust_checkpoint)
    lora = detect_lora(config, checkpoint)  # None without LoRA; LoRA faults are refused here, before any output
    if lora is not None and config.extract_lora is not None:
        raise LoraError("--extract-lora needs a full-weight checkpoint, but this one is a LoRA checkpoint already; "
                        "drop --extract-lora to export its adapter (--adapter-format picks the format)")
    adapter_only = lora is not None and lora.adapter_only
    # A LoRA-only adapter needs no local base: its base may be a Hub name.
    paths = resolve_adapter_inputs(config) if adapter_only else resolve_inputs(config)
    target = paths["target"]
    model_config = model_config_source(config, checkpoint.format, paths["config_dir"], paths.get("base"))
    # The tensors the checkpoint really holds bound the meta builds of the schema step, so no config
    # value can make them run away.
    held = len(checkpoint.keys)
    if adapter_only:
        assert lora is not None
        actor_config = read_model_config(model_config.path, model_config.error, model_config.what)
        with tensor_budget(TensorBudget.for_checkpoint(held, actor_config)):
            decided = _adapter_export(config, lora, paths.get("base"), actor_config)
    else:
        decided = _model_export(config, lora, paths["base"], model_config, held)
        if config.extract_lora is not None:
            decided = _extract_export(config, decided)
    inputs = ([actor / name for name in checkpoint.marker_files] + [model_config.path]
              + [actor / n for n in checkpoint.files])
    stamps = {str(p): FileStamp.of(p) for p in inputs}
    stamps.update(decided.stamps)
    options = resolved_path_options({k: v for k, v in config.to_dict().items() if k not in _NOT_FINGERPRINTED})
    fp = fingerprint([options, {k: list(v.__dict__.values()) for k, v in stamps.items()}, str(target), decided.base.files])
    schema = decided.schema
    named = (decided.lora.base_model_name_or_path if decided.lora else
             decided.extract.base_model_name_or_path if decided.extract else None)
    # --base_model names the base by its Hub id only when it is no local folder (an adapter's base).
    given = config.base_model if config.base_model and not Path(config.base_model).expanduser().exists() else None
    base = replace(decided.base, hub_id=base_model_id(config.base_model_id, decided.base.base_dir, named or given))
    return MergePlan(
        options=ExportOptions(dtype=config.dtype, max_shard_size=config.max_shard_size,  # type: ignore[arg-type]
                              trust_checkpoint=config.trust_checkpoint, workers=config.workers,
                              sign_key=str(Path(config.sign_key).expanduser().resolve()) if config.sign_key else None),
        checkpoint=CheckpointInputs(actor_dir=str(actor), config_dir=str(model_config.path.parent),
                                    world_size=checkpoint.world_size, fsdp_version=checkpoint.fsdp_version,
                                    rank_files=checkpoint.files, config_sha256=sha256_file(model_config.path),
                                    format=checkpoint.format, config_logical_path=model_config.logical_path),
        base=base,
        output=OutputTarget(target=str(target), staging=str(staging_dir_for(target, fp)), lock=str(lock_path_for(target)),
                            artifact_type=schema.artifact_type, architecture=schema.architecture,
                            transformer_class=schema.transformer_class, component=config.component,
                            tensor_directory=schema.tensor_directory, weights_name=schema.weights_name,
                            expected_shapes=schema.expected_shapes, keep_fp32=schema.keep_fp32, kind=schema.output,
                            base_weights=schema.base_weights, header_metadata=schema.header_metadata),
        input_stamps=stamps,
        fingerprint=fp,
        lora=decided.lora,
        conversion=schema.conversion,
        extract=decided.extract,
    )


def _model_export(config: ModelMergerConfig, lora: LoraSpec | None, base: Path, model_config: ModelConfigSource,
                  held: int) -> _Decided:
    """A pipeline or standalone transformer: the local base's schema, files and (for LoRA) weights."""
    layout = base_layout(base, config.component)
    check_output_format(config, layout)
    actor_config = read_model_config(model_config.path, model_config.error, model_config.what)
    budget = TensorBudget.for_checkpoint(held, actor_config, _base_config_if_readable(layout.transformer_dir / "config.json"))
    with tensor_budget(budget):
        schema = model_output(config.output_format).target(config, base, layout, actor_config)
    stamps = dict(schema.base_stamps)
    files = dict(schema.base_files)
    if lora is not None:
        lora_inputs = finish_lora_spec(lora, config, base, layout, schema.component_dir, schema.base_weights_name)
        stamps.update(lora_inputs.stamps)
        files.update(lora_inputs.base_files)
        lora = lora_inputs.spec
    return _Decided(schema, BaseInputs(base_dir=str(base), kind=layout.kind, component_dir=str(schema.component_dir),  # type: ignore[arg-type]
                                       files=files, copy_files=schema.copy_files), lora, stamps)


def _extract_export(config: ModelMergerConfig, decided: _Decided) -> _Decided:
    """--extract-lora: the model export's base and schema, but the artifact is the adapter alone (nothing copied).

    The base's weight files are stamped and hashed: the adapter is a difference from exactly those bytes.
    """
    schema = decided.schema
    base = Path(decided.base.base_dir)
    weights = read_weight_map(schema.component_dir, schema.base_weights_name, BaseModelError, "the base")
    renamed = schema.conversion.output_shapes
    if renamed is not None and not set(renamed) <= set(weights):  # an original single file's keys, say
        raise UsageError(f"--extract-lora keys the adapter by the base's module names, which --output_format "
                         f"{config.output_format} renames; pass --output_format transformer (or pipeline)")
    stamps, files = dict(decided.stamps), dict(decided.base.files)
    for file_name in sorted(set(weights.values())):
        path = schema.component_dir / file_name
        stamps[str(path)] = FileStamp.of(path)
        files[path.relative_to(base).as_posix()] = sha256_file(path)
    reference = base_model_reference(config.base_model or "", base.name,
                                     _recorded_name(base, base_layout(base, config.component)))
    spec = ExtractSpec(config.extract_lora or 0, config.extract_energy, config.adapter_format, reference, weights)
    out = adapter_output(config.adapter_format)
    adapter_schema = replace(schema, tensor_directory=".", artifact_type=out.artifact_types[0],  # type: ignore[arg-type]
                             weights_name=out.weights_name, output=out.name, copy_files=(),
                             base_weights=schema.base_weights_name, header_metadata=None)
    return _Decided(adapter_schema, replace(decided.base, files=dict(sorted(files.items())), copy_files=()), None,
                    stamps, spec)


def _base_config_if_readable(path: Path) -> ModelConfig | None:
    """The base component's config, only to name the differing values in a size refusal; the target step reads it for real."""
    try:
        return read_model_config(path, BaseModelError, "config.json of the base")
    except (MergeflowError, OSError):
        return None


def _adapter_export(config: ModelMergerConfig, lora: LoraSpec, base: Path | None, actor_config: ModelConfig) -> _Decided:
    """A LoRA-only save's adapter: the base is checked when present, else only named."""
    schema, base_inputs, spec = adapter_target(config, lora, base, actor_config)
    actor = Path(config.local_dir or "").expanduser().resolve()
    stamps = {str(p): FileStamp.of(p) for p in lora_input_files(config, actor)}
    return _Decided(schema, base_inputs, spec, stamps)
