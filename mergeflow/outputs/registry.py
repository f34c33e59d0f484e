"""The artifact outputs mergeflow knows: one row per kind, looked up by flag, plan or manifest.

Adding an output is a module with an `ArtifactOutput` subclass and a row in `_BUILTIN` (or, from
outside the package, a call to `register_output`): the `--output_format` / `--adapter-format`
choices, the plan, the writer and `test` all find it here.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from mergeflow.config import add_output_format, remove_output_format
from mergeflow.errors import ArtifactInvalidError, SchemaMismatchError, UsageError
from mergeflow.formats.manifest import ManifestDocument
from mergeflow.outputs.base import ArtifactOutput, ModelOutput
from mergeflow.outputs.comfyui_lora import ComfyuiLora
from mergeflow.outputs.diffusers_lora import DiffusersLora
from mergeflow.outputs.diffusers_pipeline import DiffusersPipeline
from mergeflow.outputs.diffusers_transformer import DiffusersTransformer
from mergeflow.outputs.gguf import Gguf
from mergeflow.outputs.lora_adapter import AdapterOutput
from mergeflow.outputs.peft_adapter import PeftAdapter
from mergeflow.outputs.single_file import SingleFile

if TYPE_CHECKING:
    from mergeflow.records import MergePlan, OutputPlan, TensorWrite

# Order matters only for listings: the first output_format row is the --output_format default's.
_BUILTIN: tuple[ArtifactOutput, ...] = (DiffusersPipeline(), DiffusersTransformer(), SingleFile(), Gguf(), PeftAdapter(),
                                        DiffusersLora(), ComfyuiLora())
_OUTPUTS: dict[str, ArtifactOutput] = {}


def register_output(output: ArtifactOutput) -> ArtifactOutput:
    """Make `output` known to the flags, the merge flow and `test`; refused when its name or flag value is taken."""
    if output.name in _OUTPUTS:
        raise ValueError(f"an output named {output.name!r} is already registered")
    if any(o.selected_by == output.selected_by and o.option_value == output.option_value for o in _OUTPUTS.values()):
        raise ValueError(f"--{output.selected_by} {output.option_value} already selects another output")
    _OUTPUTS[output.name] = output
    if output.selected_by == "output_format":
        add_output_format(output.option_value)
    return output


def unregister_output(name: str) -> None:
    """Forget a registered output (a test's toy); the built-in ones stay."""
    if any(o.name == name for o in _BUILTIN):
        raise ValueError(f"{name!r} is a built-in output")
    gone = _OUTPUTS.pop(name, None)
    if gone is not None and gone.selected_by == "output_format":
        remove_output_format(gone.option_value)


for _output in _BUILTIN:
    register_output(_output)


def outputs() -> tuple[ArtifactOutput, ...]:
    return tuple(_OUTPUTS.values())


def option_values(selected_by: str) -> tuple[str, ...]:
    """The values of --output_format (or --adapter-format): the choices the flags offer."""
    return tuple(o.option_value for o in _OUTPUTS.values() if o.selected_by == selected_by)


def artifact_types() -> tuple[str, ...]:
    """Every manifest artifact_type some output writes (what `test` accepts)."""
    return tuple(dict.fromkeys(t for o in _OUTPUTS.values() for t in o.artifact_types))


def model_output(output_format: str) -> ModelOutput:
    """The output --output_format names."""
    for o in _OUTPUTS.values():
        if o.selected_by == "output_format" and o.option_value == output_format and isinstance(o, ModelOutput):
            return o
    raise UsageError(f"--output_format must be one of {', '.join(option_values('output_format'))}, not {output_format!r}")


def adapter_output(adapter_format: str) -> AdapterOutput:
    """The output --adapter-format names."""
    for o in _OUTPUTS.values():
        if o.selected_by == "adapter_format" and o.option_value == adapter_format and isinstance(o, AdapterOutput):
            return o
    raise UsageError(f"--adapter-format must be one of {', '.join(option_values('adapter_format'))}")


def output_of(plan: MergePlan) -> ArtifactOutput:
    """The output a plan writes (its `output.kind`)."""
    return _OUTPUTS[plan.output.kind]


def output_for_manifest(manifest: ManifestDocument) -> ArtifactOutput:
    """The output whose artifact a (schema-checked) manifest describes."""
    candidates = [o for o in _OUTPUTS.values() if manifest["artifact_type"] in o.artifact_types]
    for o in candidates:
        if o.claims(manifest):
            return o
    if not candidates:
        raise ArtifactInvalidError(f"manifest artifact_type {manifest['artifact_type']!r} is unknown")
    raise ArtifactInvalidError(candidates[0].unclaimed(manifest, candidates))


def output_writes(plan: MergePlan, writes: list[TensorWrite]) -> list[TensorWrite]:
    """The writes in the artifact's layout: the architecture's conversion, then the output's key mapping."""
    from mergeflow.architectures.conversions import convert_writes  # torch

    writes = convert_writes(plan.conversion, writes)
    output = output_of(plan)
    if not output.maps_tensors():
        return writes
    mapped = []
    for write in writes:
        name, shape = output.map_tensor(write.name, tuple(write.layout.shape))
        if tuple(shape) != tuple(write.layout.shape):
            # The writer streams each tensor in its source layout; a reshape needs a writer that applies it.
            raise SchemaMismatchError(f"output {output.name} maps {write.name} to shape {list(shape)}: "
                                      "the safetensors writer keeps shapes")
        mapped.append(replace(write, name=name))
    names = [w.name for w in mapped]
    if len(set(names)) != len(names):
        raise SchemaMismatchError(f"output {output.name} maps two tensors to one name")
    return mapped


def pack_output(plan: MergePlan, writes: list[TensorWrite]) -> OutputPlan:
    """The artifact's weight files, as the output's writer groups them, with the header metadata it planned."""
    packed = output_of(plan).writer.pack(writes, plan.options.max_shard_size, plan.output.weights_name, plan.fingerprint)
    metadata = plan.output.header_metadata
    if metadata is None:
        return packed
    from mergeflow.formats.manifest import fingerprint

    # The metadata is part of the file's bytes: a staged file reused on resume must have been written with it.
    return replace(packed, shards=tuple(replace(shard, metadata=dict(metadata), fingerprint=fingerprint([shard.fingerprint, metadata]))
                                        for shard in packed.shards))


def plan_output(plan: MergePlan, writes: list[TensorWrite]) -> OutputPlan:
    """The planned tensors as the artifact's files: converted, mapped to the output's keys, then packed."""
    return pack_output(plan, output_writes(plan, writes))
