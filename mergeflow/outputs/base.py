"""The protocol of an artifact output, and the weights writer it plugs in.

Model outputs (a Diffusers pipeline, a standalone transformer) are planned from a base and the
checkpoint's config (`ModelOutput.target`); adapter outputs (`mergeflow.outputs.lora_adapter`)
write one selected LoRA adapter. Every method here is called from generic code, which never
asks which output it holds. Module imports stay light (no torch, diffusers or Prefect): `test`
and the command line's flag parsing import the registry.
"""

from __future__ import annotations

import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from mergeflow.errors import UsageError
from mergeflow.formats.manifest import ManifestDocument
from mergeflow.formats.model_config import ModelConfig

if TYPE_CHECKING:  # torch behind records and targets: named for type checkers only
    from collections.abc import Mapping, Sequence

    from mergeflow.architectures.registry import BaseLayout
    from mergeflow.config import ModelMergerConfig
    from mergeflow.export.plan.targets import TargetSchema
    from mergeflow.export.reconstruct.rebuild import PieceSource
    from mergeflow.formats.manifest import TensorInfo
    from mergeflow.records import (
        MergePlan,
        OutputPlan,
        ShardPlan,
        ShardRecord,
        TensorWrite,
    )

Shape = tuple[int, ...]
# What an output needs of --base_model: a local pipeline, a local transformer (standalone or a
# pipeline's), or nothing more than a name (an adapter: a local base is checked when given).
BaseNeed = Literal["pipeline", "transformer", "optional"]
# The flag whose value selects an output: `--output_format` for models, `--adapter-format` for adapters.
SelectedBy = Literal["output_format", "adapter_format"]


class WeightsWriter(Protocol):
    """How an output's tensors become files: packed into files, then each file written and verified.

    Today's writer is safetensors (sharded, or one file); another container (GGUF, say) is
    another implementation of these two methods.
    """

    def pack(self, writes: list[TensorWrite], max_shard_size: int, weights_name: str, plan_fingerprint: str) -> OutputPlan:
        """Group the writes into the files of the artifact (each a `ShardPlan`)."""
        ...

    def write_file(self, shard: ShardPlan, states: PieceSource, tensor_dir: Path, work_dir: Path) -> ShardRecord:
        """Write one file of the plan (or reuse a verified one) and prove its bytes."""
        ...


@dataclass(frozen=True)
class SafetensorsWriter:
    """mergeflow's streaming safetensors writer (mergeflow/export/write/shard_writer.py).

    `single_file`: every tensor in the one file named by the weights name, whatever --max_shard_size.
    """

    single_file: bool = False

    def pack(self, writes: list[TensorWrite], max_shard_size: int, weights_name: str, plan_fingerprint: str) -> OutputPlan:
        from mergeflow.export.write.shard_writer import pack_shards

        return pack_shards(writes, sys.maxsize if self.single_file else max_shard_size, weights_name, plan_fingerprint)

    def write_file(self, shard: ShardPlan, states: PieceSource, tensor_dir: Path, work_dir: Path) -> ShardRecord:
        from mergeflow.export.write.shard_writer import write_shard_file

        return write_shard_file(shard, states, tensor_dir, work_dir)


SHARDED_SAFETENSORS = SafetensorsWriter()
SINGLE_SAFETENSORS = SafetensorsWriter(single_file=True)


class ArtifactOutput(ABC):
    """One kind of artifact. Subclasses set the class attributes and the checks `test` runs."""

    name: ClassVar[str]  # the registry key, unique
    selected_by: ClassVar[SelectedBy]
    option_value: ClassVar[str]  # the value of `selected_by` that chooses this output
    artifact_types: ClassVar[tuple[str, ...]]  # the manifest's artifact_type values it writes
    base_need: ClassVar[BaseNeed]
    writer: ClassVar[WeightsWriter] = SHARDED_SAFETENSORS
    # Where this artifact sits when it is written inside another one (an adapter beside its model).
    nested_dir: ClassVar[str | None] = None
    # Whether the unchanged-weights guard compares the written tensors with the base's (False: an encoding,
    # such as GGUF, that neither reads as safetensors nor keeps the base's bits).
    compares_unchanged: ClassVar[bool] = True

    # -- the key/shape mapping hook ------------------------------------------------------------
    def map_tensor(self, name: str, shape: Shape) -> tuple[str, Shape]:
        """The name and shape of one tensor in this artifact (after any architecture conversion).

        Identity for the Diffusers outputs; an original single-file layout renames keys here.
        """
        return name, shape

    def maps_tensors(self) -> bool:
        """False when `map_tensor` is the identity, so the writes are passed on untouched."""
        return type(self).map_tensor is not ArtifactOutput.map_tensor

    def tensor_sources(self, plan: MergePlan) -> dict[str, list[list[Any]]] | None:
        """Each artifact tensor's parts in the Diffusers names (the unchanged-weights guard's map); None: the same names."""
        return None

    def manifest_layout_record(self, plan: MergePlan, shards: Sequence[ShardRecord] = ()) -> dict[str, Any] | None:
        """The manifest's `original_layout` record, for an output that renames and fuses tensors (default: none);
        `shards`: the files written, whose records it may cite."""
        return None

    def manifest_quantization_record(self, plan: MergePlan) -> dict[str, Any] | None:
        """The manifest's `quantization` record, for an output that encodes the weights (default: none)."""
        return None

    # -- what `test` checks --------------------------------------------------------------------
    def claims(self, manifest: ManifestDocument) -> bool:
        """Whether a manifest of one of `artifact_types` is this output's (adapters share one type)."""
        return True

    def unclaimed(self, manifest: ManifestDocument, others: list[ArtifactOutput]) -> str:
        """The refusal when no output of the manifest's artifact_type claims it."""
        return f"manifest artifact_type {manifest['artifact_type']!r} is unknown"

    @abstractmethod
    def check_configs(self, root: Path, manifest: ManifestDocument) -> None:
        """The artifact's configs agree with its manifest (run after the tree and hashes are proven)."""

    @abstractmethod
    def check_weights(self, root: Path, manifest: ManifestDocument) -> int:
        """The weight files hold exactly the manifest's tensors; returns how many."""

    def check_staged(self, plan: MergePlan, tensors: Mapping[str, TensorInfo]) -> None:
        """Before publish, beyond `test`: the staged artifact loads as planned (default: nothing more)."""


class ModelOutput(ArtifactOutput):
    """An output planned from a local base model and the checkpoint's model config."""

    selected_by: ClassVar[SelectedBy] = "output_format"
    # The --quantize values this output writes besides "none" (fp8 for a single file, bf16/q8_0 for GGUF).
    quantizations: ClassVar[tuple[str, ...]] = ()
    # Whether it writes nothing without one (a GGUF file is always an encoding): "none" is refused.
    needs_quantize: ClassVar[bool] = False

    def check_quantize(self, config: ModelMergerConfig) -> None:
        """Refuse a --quantize value this output does not write (pre-flight and plan)."""
        if config.quantize == "none" and self.needs_quantize:
            raise UsageError(f"--output_format {self.option_value} needs --quantize "
                             f"({' or '.join(self.quantizations)})")
        if config.quantize != "none" and config.quantize not in self.quantizations:
            offered = f"it takes {', '.join(self.quantizations)}" if self.quantizations else "it writes no quantized weights"
            raise UsageError(f"--quantize {config.quantize} is not available with --output_format {self.option_value}: "
                             f"{offered}")

    def check_base(self, config: ModelMergerConfig, layout: BaseLayout) -> None:
        """Refuse a base of the wrong kind, before any work (pre-flight and plan)."""
        if self.base_need == "pipeline" and layout.kind != "pipeline":
            raise UsageError(f"--output_format {self.option_value} needs a base pipeline (a directory with model_index.json); "
                             "use --output_format transformer for a standalone transformer base")

    def check_component(self, config: ModelMergerConfig, layout: BaseLayout) -> None:
        """Refuse a --component this output cannot replace in this base (pre-flight; default: any)."""

    def compares_classes(self, config: ModelMergerConfig, layout: BaseLayout) -> bool:
        """Whether the checkpoint's model class must equal the base transformer's (a pre-flight check)."""
        return True

    @abstractmethod
    def target(self, config: ModelMergerConfig, base: Path, layout: BaseLayout, actor_config: ModelConfig) -> TargetSchema:
        """Targets, file names, the schema to cover, base files (hashed) and the files copied from the base."""
