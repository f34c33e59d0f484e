"""`--output_format gguf --quantize bf16|q8_0`: the trained transformer as one GGUF file for city96's ComfyUI-GGUF.

The tensors are the original single-file layout's (planned by the same conversion as `single_file`), keyed
as ComfyUI-GGUF's `tools/convert.py` keys them (`model.diffusion_model.` stripped), encoded by its rules
(mergeflow/architectures/gguf_layout.py) and written by the GGUF writer (mergeflow/export/write/gguf_writer.py).

The artifact: `<component>.gguf`, the trained transformer's Diffusers `config.json` and the manifest. The
manifest's `tensors` are the original layout's tensors (GGUF keys, the source dtype and original shape),
its `original_layout` record the key map as for a single file, and its `quantization` record each tensor's
encoding with the figures `test` re-derives from the file alone (mergeflow/formats/gguf_quant.py).
Bounded error, not bit-exactness: Q8_0 tensors within their block-scale bound, BF16 the bf16 cast bit for
bit, F32 the source bit for bit.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from mergeflow.errors import ArtifactInvalidError, UsageError
from mergeflow.formats.manifest import ManifestDocument
from mergeflow.outputs.base import WeightsWriter
from mergeflow.outputs.single_file import SingleFile, check_key_map

if TYPE_CHECKING:
    from collections.abc import Mapping

    from mergeflow.architectures.registry import BaseLayout
    from mergeflow.config import ModelMergerConfig
    from mergeflow.export.plan.targets import TargetSchema
    from mergeflow.formats.manifest import TensorInfo
    from mergeflow.formats.model_config import ModelConfig
    from mergeflow.records import MergePlan

ARTIFACT_TYPE = "gguf"


def _writer() -> WeightsWriter:
    from mergeflow.export.write.gguf_writer import GGUF_WRITER

    return GGUF_WRITER


class Gguf(SingleFile):
    name: ClassVar[str] = "gguf"
    option_value: ClassVar[str] = "gguf"
    artifact_types: ClassVar[tuple[str, ...]] = (ARTIFACT_TYPE,)
    writer: ClassVar[WeightsWriter] = _writer()
    quantizations: ClassVar[tuple[str, ...]] = ("bf16", "q8_0")
    needs_quantize: ClassVar[bool] = True
    # A quantized file never equals its base bit for bit, and it is no safetensors file the guard could read.
    compares_unchanged: ClassVar[bool] = False

    def check_base(self, config: ModelMergerConfig, layout: BaseLayout) -> None:
        """Refuse, before any work, an architecture no GGUF loader reads (Boogu-Image, MiniMax H3)."""
        from mergeflow.architectures.gguf_layout import (
            NO_GGUF,
            architecture_for,
            supported_classes,
        )

        cls = layout.transformer_class
        if cls in NO_GGUF:
            raise UsageError(f"--output_format gguf: {NO_GGUF[cls]}; export --output_format single_file instead")
        super().check_base(config, layout)
        if architecture_for(cls) is None:
            raise UsageError(f"--output_format gguf has no GGUF layout for {cls} (it writes {', '.join(supported_classes())})")

    def target(self, config: ModelMergerConfig, base: Path, layout: BaseLayout, actor_config: ModelConfig) -> TargetSchema:
        from mergeflow.architectures.gguf_layout import (
            MAX_TENSOR_NAME_LENGTH,
            architecture_for,
            gguf_key,
        )
        from mergeflow.export.write.gguf_writer import (
            ARCH_KEY,
            MERGEFLOW_KEY,
            METHOD_KEY,
        )
        from mergeflow.outputs.single_file import MERGEFLOW_KEY as SINGLE_FILE_RECORD

        single = super().target(config, base, layout, actor_config)
        arch = architecture_for(single.architecture)
        if arch is None:
            raise UsageError(f"--output_format gguf has no GGUF layout for {single.architecture}")
        assert single.conversion is not None and single.conversion.output_shapes is not None
        long = [k for k in single.conversion.output_shapes if len(gguf_key(k)) > MAX_TENSOR_NAME_LENGTH]
        if long:
            raise UsageError(f"--output_format gguf: GGUF keys are at most {MAX_TENSOR_NAME_LENGTH} characters ({long[0]})")
        metadata = {ARCH_KEY: arch.name, METHOD_KEY: config.quantize,
                    MERGEFLOW_KEY: (single.header_metadata or {}).get(SINGLE_FILE_RECORD, "{}")}
        return replace(single, artifact_type=ARTIFACT_TYPE, weights_name=f"{config.component}.gguf",
                       header_metadata=metadata)

    def map_tensor(self, name: str, shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
        from mergeflow.architectures.gguf_layout import gguf_key

        return gguf_key(name), shape

    def tensor_sources(self, plan: MergePlan) -> dict[str, list[list[Any]]] | None:
        return None

    def manifest_quantization_record(self, plan: MergePlan) -> dict[str, Any] | None:
        from mergeflow.export.write.gguf_writer import recorded_quantization

        record = recorded_quantization(Path(plan.output.work_dir))
        if record is None:
            raise ArtifactInvalidError("the GGUF writer left no quantization record")
        return record

    def check_staged(self, plan: MergePlan, tensors: Mapping[str, TensorInfo]) -> None:
        from mergeflow.architectures.gguf_layout import gguf_key

        planned = plan.conversion.output_shapes or {}
        if {gguf_key(k): list(v) for k, v in planned.items()} != {k: list(v.shape) for k, v in tensors.items()}:
            raise ArtifactInvalidError("the staged GGUF tensors do not match the schema planned for this artifact")

    # -- what `test` checks ----------------------------------------------------------------------
    def check_weights(self, root: Path, manifest: ManifestDocument) -> int:
        """One GGUF file whose tensors are exactly the architecture's map, encoded as the manifest records."""
        from mergeflow.architectures.gguf_layout import gguf_key
        from mergeflow.outputs.gguf_checks import check_gguf_file

        record = manifest.get("original_layout")
        quantization = manifest.get("quantization")
        if not isinstance(record, dict) or not isinstance(quantization, dict):
            raise ArtifactInvalidError("a gguf manifest needs its original_layout and quantization records")
        weights = [rel for rel in manifest["files"] if rel.endswith(".gguf")]
        if len(weights) != 1 or any(rel.endswith(".safetensors") for rel in manifest["files"]):
            raise ArtifactInvalidError(f"a gguf artifact holds exactly one .gguf file and no safetensors, not {len(weights)}")
        key_map = record.get("key_map")
        if not isinstance(key_map, dict) or sorted(gguf_key(k) for k in key_map) != sorted(manifest["tensors"]):
            raise ArtifactInvalidError("the manifest's tensors are not its key map's, as GGUF keys")
        # The key map names the single-file keys: the GGUF keys are those with the prefix stripped.
        check_key_map(record, {k: manifest["tensors"][gguf_key(k)] for k in key_map})
        return check_gguf_file(root / weights[0], manifest, quantization)

