"""Writing `lora_adapter/`: the selected adapter's weights, its PEFT config and its own manifest."""


from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from mergeflow.export.publish import build_manifest, write_model_card
from mergeflow.formats.manifest import (
    MANIFEST_NAME,
    ConfigTransform,
    LoraAdapterRecord,
    Manifest,
    fingerprint,
    plain,
)
from mergeflow.formats.safetensors_format import nbytes
from mergeflow.formats.seal import PIN_NAME, pin_text, write_pin
from mergeflow.hub.model_card import CARD_NAME
from mergeflow.io.jsonfiles import write_bytes_durable, write_json_durable
from mergeflow.io.session import sha256_file
from mergeflow.lora.artifact import ADAPTER_DIR
from mergeflow.lora.plan import (
    LoraPlan,
)
from mergeflow.outputs.registry import adapter_output
from mergeflow.records import (
    FileRecord,
    MergePlan,
    ShardPlan,
    ShardRecord,
    TensorLayout,
    VerifiedFile,
)
from mergeflow.sources.registry import open_pieces

if TYPE_CHECKING:
    from mergeflow.lora.extraction import Extraction


def adapter_dir(plan: MergePlan) -> Path:
    """Where the exported adapter is staged: `<artifact>/lora_adapter/`."""
    return Path(plan.output.artifact_dir) / ADAPTER_DIR


@dataclass(frozen=True)
class AdapterExport:
    """A written, verified adapter directory: its files (relative to the artifact root) and manifest."""

    files: tuple[FileRecord, ...]
    manifest: Manifest
    shard: ShardRecord

    def verified(self) -> dict[str, VerifiedFile]:
        """The adapter's weights file, relative to the artifact root, as its writer proved it."""
        return {f"{ADAPTER_DIR}/{self.shard.file_name}": self.shard.verified()}


def _adapter_shard(plan: MergePlan, lora: LoraPlan, layouts: dict[str, TensorLayout]) -> ShardPlan:
    output = adapter_output(lora.adapter_format)
    writes = tuple(output.adapter_writes(plan, lora, layouts))
    metadata = output.shard_metadata(plan, lora)
    name = output.weights_name
    body = [plain(tw) for tw in writes]
    return ShardPlan(
        index=0,
        file_name=name,
        tensors=writes,
        nbytes=sum(nbytes(t.out_dtype, t.layout.shape) for t in writes),
        fingerprint=fingerprint([plan.fingerprint, ADAPTER_DIR, name, body, metadata, "adapter-v1"]),
        metadata=metadata,
    )


def _adapter_manifest(plan: MergePlan, lora: LoraPlan, rank_digests: dict[str, str], shard: ShardRecord,
                      files: list[FileRecord]) -> Manifest:
    # An extraction (--extract-lora) has no LoRA spec: its plan names the base.
    base_name = plan.lora.base_model_name_or_path if plan.lora else plan.extract.base_model_name_or_path if plan.extract else ""
    # The adapter directory is an artifact of its own: tensors at its root, its own file list.
    output = adapter_output(lora.adapter_format)
    own = replace(plan, output=replace(plan.output, artifact_type=output.artifact_types[0], tensor_directory=".",
                                       kind=output.name))
    manifest = build_manifest(own, rank_digests, [shard], files, ConfigTransform(removed_keys={}))
    return replace(manifest, lora_adapter=LoraAdapterRecord(
        adapter_name=lora.adapter_name,
        format=lora.adapter_format,
        base_model_name_or_path=base_name,
        layout=lora.layout,
        r=lora.r,
        lora_alpha=lora.lora_alpha,
        target_modules=tuple(sorted((lora.adapter_config or {}).get("target_modules") or [])),
        excluded_adapters=tuple(lora.excluded_adapters),
        settings_source=lora.settings_origin,
    ))


def write_adapter(plan: MergePlan, lora: LoraPlan, layouts: dict[str, TensorLayout],
                  rank_digests: dict[str, str], extraction: Extraction | None = None) -> AdapterExport:
    """Write `lora_adapter/`: weights (streamed, round-trip verified), adapter_config.json, its manifest.

    An extraction's factors are read from its work files (its layouts join the checkpoint's) and its
    record, lora_extraction.json, is written beside them with the weights file's size.
    """
    out_dir = adapter_dir(plan)
    out_dir.mkdir(parents=True, exist_ok=True)
    work = Path(plan.output.work_dir) / ADAPTER_DIR
    work.mkdir(parents=True, exist_ok=True)
    states = open_pieces(plan.checkpoint, trust_checkpoint=plan.options.trust_checkpoint)
    if extraction is not None:
        from mergeflow.lora.extraction import ExtractedPieces

        states = ExtractedPieces(states, extraction.files)
        layouts = {**layouts, **extraction.layouts}
    shard = _adapter_shard(plan, lora, layouts)
    record = adapter_output(lora.adapter_format).writer.write_file(shard, states, out_dir, work)
    files: list[FileRecord] = []
    for file_name, raw in adapter_output(lora.adapter_format).extra_files(lora.adapter_config or {}):
        write_bytes_durable(out_dir / file_name, raw)
        files.append(FileRecord(file_name, sha256_file(out_dir / file_name), len(raw), "written"))
    if extraction is not None:
        from mergeflow.lora.extract_spec import EXTRACTION_NAME
        from mergeflow.lora.extraction import record_bytes

        summary = {**extraction.record["summary"], "adapter_file": record.file_name, "adapter_file_bytes": record.size}
        raw = record_bytes({**extraction.record, "summary": summary})
        write_bytes_durable(out_dir / EXTRACTION_NAME, raw)
        files.append(FileRecord(EXTRACTION_NAME, sha256_file(out_dir / EXTRACTION_NAME), len(raw), "written"))
    manifest = _adapter_manifest(plan, lora, rank_digests, record, files)
    manifest = write_model_card(plan, manifest, out_dir, record.file_name)
    files.append(FileRecord(CARD_NAME, manifest.files[CARD_NAME], (out_dir / CARD_NAME).stat().st_size, "written"))
    data = write_json_durable(out_dir / MANIFEST_NAME, manifest.to_json(), indent=2)
    listed = [(record.file_name, record.sha256, record.size)] + [(f.rel_path, f.sha256, f.size) for f in files]
    listed.append((MANIFEST_NAME, sha256_file(out_dir / MANIFEST_NAME), len(data)))
    # Its own pin: the directory validates as an artifact wherever it is copied (beside a model, the
    # model's manifest lists it; alone, it is the artifact and the seal step writes the same pin again).
    write_pin(out_dir, listed[-1][1])
    listed.append((PIN_NAME, sha256_file(out_dir / PIN_NAME), len(pin_text(listed[-1][1]))))
    rooted = tuple(FileRecord(f"{ADAPTER_DIR}/{name}", digest, size, "written") for name, digest, size in listed)
    return AdapterExport(files=rooted, manifest=manifest, shard=record)
