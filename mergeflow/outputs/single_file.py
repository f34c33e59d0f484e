"""`--output_format single_file`: the trained transformer as one safetensors file in its authors' original layout.

What ComfyUI (`models/diffusion_models/`) and Diffusers' `from_single_file` load: BFL's Flux keys,
Stability's MMDiT keys, Wan-AI's, Lightricks'... Each architecture's key map is an `OriginalLayout`
beside the architecture (mergeflow/architectures/original_layout.py); this output plans it as the
export's tensor conversion, so the writer builds each fused tensor from its sources one at a time
and re-verifies every row block against the tensor it came from.

The artifact: `<component>.safetensors` (header metadata in the ModelSpec convention single-file
tools read, plus mergeflow's own record), the trained transformer's Diffusers `config.json` (what
`from_single_file(file, config=DIR)` needs), and the manifest. The manifest's `original_layout`
record maps every file key to its Diffusers source tensors and rows, so `test` checks the file's
key set and shapes against the architecture's map without the training checkpoint.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from mergeflow.errors import ArtifactInvalidError, SchemaMismatchError, UsageError
from mergeflow.formats.manifest import ManifestDocument
from mergeflow.formats.safetensors_format import DATA_HASH_KEY, DATA_HASH_PLACEHOLDER, read_header
from mergeflow.outputs.base import SINGLE_SAFETENSORS, WeightsWriter
from mergeflow.outputs.checks import check_manifest_tensors
from mergeflow.outputs.diffusers_transformer import WEIGHTS_NAME, DiffusersTransformer

if TYPE_CHECKING:
    from mergeflow.architectures.registry import BaseLayout
    from mergeflow.config import ModelMergerConfig
    from mergeflow.export.plan.targets import TargetSchema
    from mergeflow.export.reconstruct.rebuild import PieceSource
    from mergeflow.formats.model_config import ModelConfig
    from mergeflow.records import (
        MergePlan,
        OutputPlan,
        ShardPlan,
        ShardRecord,
        TensorWrite,
    )

ARTIFACT_TYPE = "single_file"
MODELSPEC_VERSION = "1.0.0"
# The header keys every single file carries (SAI's ModelSpec: modelspec.* as kohya's tools and ComfyUI read them).
MODELSPEC_KEYS = ("modelspec.sai_model_spec", "modelspec.architecture", "modelspec.implementation",
                  "modelspec.title", "modelspec.date", DATA_HASH_KEY)
# The manifest's record of the data hash the writer put in the header (proven from the bytes written).
DATA_HASH_RECORD = "modelspec_hash_sha256"
MERGEFLOW_KEY = "mergeflow"  # mergeflow's own record in the header: producer version, layout, Diffusers class


def file_name(component: str) -> str:
    """The weights file: named after the component it replaces (`transformer`, Wan 2.2's `transformer_2`)."""
    return f"{component}.safetensors"


def _title(config: ModelMergerConfig) -> str:
    """`<run> step <N>` when the checkpoint sits in verl's layout, else the target's name (never a path)."""
    from mergeflow.formats.verl_checkpoint import verl_run_step

    found = verl_run_step(Path(config.local_dir or "").expanduser())
    if found is not None:
        return f"{found[0]} step {found[1]}"
    return Path(config.target_dir or "artifact").name


def _checkpoint_date(config: ModelMergerConfig) -> str:
    """The checkpoint's date (its directory's last change, UTC): the same inputs give the same bytes."""
    stamp = os.stat(Path(config.local_dir or ".").expanduser()).st_mtime
    return datetime.fromtimestamp(stamp, tz=timezone.utc).replace(microsecond=0).isoformat()


class SingleFileWriter:
    """The one-file safetensors writer; an fp8 file's measured quantization records are kept beside it."""

    def pack(self, writes: list[TensorWrite], max_shard_size: int, weights_name: str, plan_fingerprint: str) -> OutputPlan:
        return SINGLE_SAFETENSORS.pack(writes, max_shard_size, weights_name, plan_fingerprint)

    def write_file(self, shard: ShardPlan, states: PieceSource, tensor_dir: Path, work_dir: Path) -> ShardRecord:
        from mergeflow.export.write.quantized import write_measured_file

        return write_measured_file(shard, states, tensor_dir, work_dir)


class SingleFile(DiffusersTransformer):
    name: ClassVar[str] = "single_file"
    option_value: ClassVar[str] = "single_file"
    artifact_types: ClassVar[tuple[str, ...]] = (ARTIFACT_TYPE,)
    writer: ClassVar[WeightsWriter] = SingleFileWriter()
    quantizations: ClassVar[tuple[str, ...]] = ("fp8",)

    def check_quantize(self, config: ModelMergerConfig) -> None:
        super().check_quantize(config)
        if config.quantize == "fp8" and config.dtype not in ("preserve", "bfloat16"):
            raise UsageError(f"--quantize fp8 writes every unquantized tensor bf16 (as ComfyUI's fp8 files hold them), "
                             f"not {config.dtype}: drop --dtype or pass --dtype bfloat16")

    def check_base(self, config: ModelMergerConfig, layout: BaseLayout) -> None:
        """Refuse, before any work, an architecture no single-file loader reads (Boogu-Image)."""
        from mergeflow.architectures.original_layout import NO_SINGLE_FILE

        super().check_base(config, layout)
        cls = layout.transformer_class
        if cls in NO_SINGLE_FILE:
            raise UsageError(f"--output_format single_file: {NO_SINGLE_FILE[cls]}")

    def target(self, config: ModelMergerConfig, base: Path, layout: BaseLayout, actor_config: ModelConfig) -> TargetSchema:
        from mergeflow.architectures.original_layout import (
            LAYOUT_PARAM,
            ORIGINAL_LAYOUT,
            fp8_keys,
            layout_for,
            original_shapes,
        )
        from mergeflow.architectures.quantization import (
            FP8,
            METADATA_KEY,
            QUANTIZE_PARAM,
            comfy_metadata,
        )
        from mergeflow.formats.manifest import producer_versions
        from mergeflow.records import Conversion

        inner, schema = self.target_and_schema(config, base, layout, actor_config)
        original = layout_for(schema.class_name)
        params = {LAYOUT_PARAM: original.name, **original.params(schema.fields)}
        if config.quantize == FP8:
            if original.fp8 is None:
                raise UsageError(f"--quantize fp8: the {original.name} layout declares no fp8 quantization rule")
            params[QUANTIZE_PARAM] = FP8
        shapes = original_shapes(original, schema.tensors, params)
        metadata = {
            "format": "pt",
            "modelspec.sai_model_spec": MODELSPEC_VERSION,
            "modelspec.architecture": original.architecture(schema.fields),
            "modelspec.implementation": original.implementation,
            "modelspec.title": _title(config),
            "modelspec.date": _checkpoint_date(config),
            DATA_HASH_KEY: DATA_HASH_PLACEHOLDER,  # the writer fills it in (the data's sha256)
        }
        resolution = original.resolution(schema.fields)
        if resolution is not None:
            metadata["modelspec.resolution"] = resolution
        quantized = fp8_keys(original, shapes, params)
        if config.quantize == FP8 and not quantized:
            raise UsageError(f"--quantize fp8: the {original.name} rule finds no linear weight in the transformer blocks")
        if quantized:
            metadata[METADATA_KEY] = comfy_metadata(quantized)
        metadata[MERGEFLOW_KEY] = json.dumps({"producer": producer_versions().get("mergeflow", ""),
                                              "original_layout": original.name,
                                              "transformer_class": schema.class_name}, sort_keys=True)
        return replace(inner, artifact_type=ARTIFACT_TYPE, weights_name=file_name(config.component),
                       base_weights=WEIGHTS_NAME, header_metadata=metadata,
                       conversion=Conversion(adapter=ORIGINAL_LAYOUT.name, adapter_params=params, output_shapes=shapes))

    # -- what `test` checks ----------------------------------------------------------------------
    def check_weights(self, root: Path, manifest: ManifestDocument) -> int:
        """One weights file, its ModelSpec header, and its keys and shapes exactly the architecture's map."""
        record = manifest.get("original_layout")
        if not isinstance(record, dict):
            raise ArtifactInvalidError("a single_file manifest needs its original_layout record")
        weights = [rel for rel in manifest["files"] if rel.endswith(".safetensors")]
        if len(weights) != 1:
            raise ArtifactInvalidError(f"a single_file artifact holds exactly one .safetensors file, not {len(weights)}")
        count = check_manifest_tensors(root, manifest, (weights[0],))
        _, metadata, _ = read_header(root / weights[0])
        missing = [k for k in MODELSPEC_KEYS if not metadata.get(k)]
        if missing:
            raise ArtifactInvalidError(f"{weights[0]}: header metadata lacks {', '.join(missing)}")
        # The file's sha256 (checked against the manifest before this) pins the header; the recorded
        # value was hashed from the very data bytes the export wrote and read back.
        if metadata[DATA_HASH_KEY] != record.get(DATA_HASH_RECORD):
            raise ArtifactInvalidError(f"{weights[0]}: its {DATA_HASH_KEY} is not the data hash the manifest records")
        check_key_map(record, manifest["tensors"])
        from mergeflow.outputs.fp8_checks import check_quantization

        check_quantization(root / weights[0], record, manifest)
        return count

    def manifest_layout_record(self, plan: MergePlan, shards: Sequence[ShardRecord] = ()) -> dict[str, Any] | None:
        record = key_map_record(plan)
        hashes = [s.data_sha256 for s in shards if s.data_sha256]
        if len(hashes) == 1:
            record[DATA_HASH_RECORD] = hashes[0]
        return record

    def manifest_quantization_record(self, plan: MergePlan) -> dict[str, Any] | None:
        from mergeflow.outputs.fp8_checks import quantization_record

        return quantization_record(plan)

    def tensor_sources(self, plan: MergePlan) -> dict[str, list[list[Any]]] | None:
        return dict(key_map_record(plan)["key_map"])


def key_map_record(plan: MergePlan) -> dict[str, Any]:
    """The manifest's `original_layout` record: the layout, its params and file key -> [source, rows, swapped]."""
    from mergeflow.architectures.original_layout import (
        LAYOUT_PARAM,
        key_map,
        layout_named,
    )

    params = dict(plan.conversion.adapter_params)
    layout = layout_named(str(params[LAYOUT_PARAM]))
    return {"layout": layout.name, "params": params, "key_map": key_map(layout, plan.output.expected_shapes, params)}


def check_key_map(record: Mapping[str, Any], tensors: Mapping[str, Any]) -> None:
    """The file's keys and shapes are what the architecture's map makes of the Diffusers tensors it names.

    The Diffusers shapes follow from the record and the file (a row block's rows, the file tensor's
    other dims); the layout's own plan over those shapes must give back exactly the recorded map.
    """
    from mergeflow.architectures.original_layout import (
        key_map,
        layout_named,
        original_shapes,
    )

    try:
        layout = layout_named(str(record.get("layout")))
        params = dict(record.get("params") or {})
        recorded: Mapping[str, list[list[Any]]] = record["key_map"]
        shapes: dict[str, tuple[int, ...]] = {}
        for key, entries in recorded.items():
            file_shape = tuple(tensors[key]["shape"])
            for source, start, end, _swapped in entries:
                # A whole tensor has the file tensor's shape; a row block its rows and the other dims.
                shapes[source] = file_shape if len(entries) == 1 else (int(end) - int(start), *file_shape[1:])
        planned = key_map(layout, shapes, params)
        want = original_shapes(layout, shapes, params)
    except (KeyError, TypeError, ValueError, SchemaMismatchError) as err:
        raise ArtifactInvalidError(f"the manifest's original_layout record does not fit its layout: {err}") from None
    if planned != {k: [list(e) for e in v] for k, v in recorded.items()}:
        raise ArtifactInvalidError("the manifest's key map is not what the original layout maps its tensors to")
    have = {k: tuple(v["shape"]) for k, v in tensors.items()}
    if want != have:
        extra, missing = sorted(set(have) - set(want)), sorted(set(want) - set(have))
        wrong = sorted(k for k in set(have) & set(want) if have[k] != want[k])
        raise ArtifactInvalidError(f"the file's tensors are not the {layout.name} layout "
                                   f"(extra {extra[:3]}, missing {missing[:3]}, other shapes {wrong[:3]})")
