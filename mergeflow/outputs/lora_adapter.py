"""What every exported LoRA adapter shares: `lora_adapter/`, one weights file, its own manifest.

An adapter directory is an artifact of its own (its manifest lists its files and tensors), so it can
be validated wherever it is copied. When it sits inside a model export, the root manifest also lists
its files, so the root's file tree stays exact. A LoRA-only adapter export has no root manifest: its
target holds `lora_adapter/` and nothing else. The adapter formats (peft_adapter.py,
diffusers_lora.py) differ in their weights name, keys, header metadata and extra files.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from mergeflow.errors import ArtifactInvalidError
from mergeflow.formats.manifest import LoraAdapterJson, ManifestDocument
from mergeflow.formats.safetensors_format import read_header
from mergeflow.lora.artifact import ADAPTER_DIR
from mergeflow.outputs.base import ArtifactOutput, BaseNeed, SelectedBy

if TYPE_CHECKING:
    from mergeflow.lora.keys import AdapterModuleKeys
    from mergeflow.lora.plan import LoraPlan
    from mergeflow.records import MergePlan, TensorLayout, TensorWrite

ADAPTER_ARTIFACT_TYPE = "peft_adapter"


class AdapterOutput(ArtifactOutput):
    """One selected adapter of a LoRA checkpoint, written to `lora_adapter/` (manifest type peft_adapter)."""

    selected_by: ClassVar[SelectedBy] = "adapter_format"
    artifact_types: ClassVar[tuple[str, ...]] = (ADAPTER_ARTIFACT_TYPE,)
    base_need: ClassVar[BaseNeed] = "optional"
    nested_dir: ClassVar[str | None] = ADAPTER_DIR
    weights_name: ClassVar[str]
    key_prefix: ClassVar[str]  # every tensor key of the weights file starts with it

    # -- writing ---------------------------------------------------------------------------------
    @abstractmethod
    def adapter_keys(self, adapter_name: str, modules: Mapping[str, AdapterModuleKeys],
                     saved: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
        """Output key -> checkpoint key for the selected adapter (its modules_to_save copies: `saved`)."""

    @abstractmethod
    def header_metadata(self, adapter_config: Mapping[str, Any]) -> dict[str, str]:
        """The weights file's safetensors header metadata."""

    def adapter_writes(self, plan: MergePlan, lora: LoraPlan, layouts: Mapping[str, TensorLayout]) -> list[TensorWrite]:
        """The weights file's tensors; by default each a plain copy of its checkpoint key (`lora.adapter_keys`)."""
        from mergeflow.export.reconstruct.rebuild import (
            output_dtype,  # torch: only when planning writes
        )
        from mergeflow.records import TensorWrite

        policy, keep = plan.options.dtype, plan.output.keep_fp32
        return [TensorWrite(out, src, layouts[src], output_dtype(out, layouts[src].dtype, policy, keep))
                for out, src in sorted(lora.adapter_keys.items())]

    def carries_diffs(self) -> bool:
        """Whether an --extract-lora adapter in this format holds `.diff` / `.diff_b` entries for the changed
        tensors no LoRA carries (mergeflow.lora.diffs; which ones, the architecture's naming says)."""
        return False

    def carried_modules(self, transformer_class: str, modules: list[str]) -> set[str]:
        """The modules (of an --extract-lora adapter) this format has keys for; by default every module."""
        return set(modules)

    def shard_metadata(self, plan: MergePlan, lora: LoraPlan) -> dict[str, str]:
        """The header metadata of this export's weights file (by default `header_metadata` of its config)."""
        return self.header_metadata(lora.adapter_config or {})

    def extra_files(self, adapter_config: Mapping[str, Any]) -> list[tuple[str, bytes]]:
        """Files written beside the weights (name, bytes), listed in the adapter's manifest."""
        return []

    # -- what `test` checks ----------------------------------------------------------------------
    def claims(self, manifest: ManifestDocument) -> bool:
        record = manifest.get("lora_adapter")
        return isinstance(record, dict) and record.get("format") == self.option_value

    def unclaimed(self, manifest: ManifestDocument, others: list[ArtifactOutput]) -> str:
        formats = " or ".join(repr(o.option_value) for o in others)
        return f"a {ADAPTER_ARTIFACT_TYPE} manifest needs lora_adapter.format {formats}"

    def check_configs(self, root: Path, manifest: ManifestDocument) -> None:
        """An adapter's own config is checked with its weights (check_extra)."""

    def check_extra(self, root: Path, record: LoraAdapterJson) -> None:
        """The files beside the weights agree with the manifest's lora_adapter record."""

    def check_metadata(self, file_name: str, metadata: dict[str, str]) -> None:
        if metadata.get("format") != "pt":
            raise ArtifactInvalidError(f"{file_name}: header metadata lacks format 'pt'")

    def check_weights(self, root: Path, manifest: ManifestDocument) -> int:
        """The adapter's config and weight file agree with its manifest; returns the tensor count."""
        record = manifest["lora_adapter"]
        file_name = self.weights_name
        if file_name not in manifest["files"]:
            raise ArtifactInvalidError(f"the adapter manifest does not list {file_name}")
        self.check_extra(root, record)
        from mergeflow.lora.extract_spec import EXTRACTION_NAME

        if EXTRACTION_NAME in manifest["files"]:  # an extracted adapter: its record must match the factors
            from mergeflow.lora.extraction_check import check_extraction

            check_extraction(root, manifest, file_name)
        entries, metadata, _ = read_header(root / file_name)
        self.check_metadata(file_name, metadata)
        prefix = self.key_prefix
        odd = sorted(key for key in entries if not key.startswith(prefix))
        if odd:
            raise ArtifactInvalidError(f"{file_name} holds {odd[0]}, which does not start with {prefix!r}")
        tensors = manifest["tensors"]
        if set(entries) != set(tensors):
            extra, missing = sorted(set(entries) - set(tensors)), sorted(set(tensors) - set(entries))
            raise ArtifactInvalidError(f"{file_name} and the manifest disagree on the tensor set (extra {extra[:3]}, missing {missing[:3]})")
        for key, entry in entries.items():
            info = tensors[key]
            if info["dtype"] != entry.dtype or list(entry.shape) != info["shape"]:
                raise ArtifactInvalidError(f"{key} is {entry.dtype}{list(entry.shape)} in {file_name} but {info['dtype']}{info['shape']} in the manifest")
        return len(entries)
