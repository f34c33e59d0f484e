"""`--adapter-format diffusers`: Diffusers' LoRA file, as a pipeline's `save_lora_weights` writes it.

`pytorch_lora_weights.safetensors` with `transformer.<module>.lora_A.weight` keys and the LoraConfig
as JSON under the header key `lora_adapter_metadata` (without it `load_lora_weights` takes
lora_alpha = r). It cannot carry modules_to_save.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from mergeflow.errors import ArtifactInvalidError, LoraError
from mergeflow.io.jsonfiles import parse_json_strict
from mergeflow.lora.export import (
    DIFFUSERS_LORA_WEIGHTS_NAME,
    DIFFUSERS_METADATA_KEY,
    diffusers_lora_keys,
    diffusers_lora_metadata,
)
from mergeflow.outputs.lora_adapter import AdapterOutput

if TYPE_CHECKING:
    from mergeflow.lora.keys import AdapterModuleKeys


class DiffusersLora(AdapterOutput):
    name: ClassVar[str] = "diffusers_lora"
    option_value: ClassVar[str] = "diffusers"
    weights_name: ClassVar[str] = DIFFUSERS_LORA_WEIGHTS_NAME
    key_prefix: ClassVar[str] = "transformer."

    def adapter_keys(self, adapter_name: str, modules: Mapping[str, AdapterModuleKeys],
                     saved: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
        if saved:
            raise LoraError(f"adapter {adapter_name!r} has modules_to_save ({', '.join(sorted(saved))}), "
                            "which Diffusers' LoRA format cannot carry; export it in PEFT format")
        return diffusers_lora_keys(modules)

    def header_metadata(self, adapter_config: Mapping[str, Any]) -> dict[str, str]:
        return diffusers_lora_metadata(adapter_config)

    def check_metadata(self, file_name: str, metadata: dict[str, str]) -> None:
        super().check_metadata(file_name, metadata)
        raw = metadata.get(DIFFUSERS_METADATA_KEY)
        packed = parse_json_strict(raw, ArtifactInvalidError, f"{file_name}: header {DIFFUSERS_METADATA_KEY}") if isinstance(raw, str) and raw else None
        if not isinstance(packed, dict) or not packed:
            # Without it Diffusers silently takes lora_alpha = r (SPEC section 4).
            raise ArtifactInvalidError(f"{file_name}: header lacks a valid {DIFFUSERS_METADATA_KEY}")

