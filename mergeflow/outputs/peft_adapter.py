"""`--adapter-format peft` (the default): PEFT's adapter directory.

`adapter_model.safetensors` with `base_model.model.<module>.lora_A.weight` keys (modules_to_save
copies under their plain module name) and `adapter_config.json` as PeftConfig.save_pretrained
writes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from mergeflow.errors import ArtifactInvalidError, LoraError
from mergeflow.formats.manifest import LoraAdapterJson
from mergeflow.io.jsonfiles import read_json_strict
from mergeflow.lora.config import ADAPTER_CONFIG_NAME, settings_from_config_dict
from mergeflow.lora.export import (
    PEFT_ADAPTER_WEIGHTS_NAME,
    adapter_config_json,
    peft_adapter_keys,
)
from mergeflow.lora.keys import PEFT_PREFIX
from mergeflow.outputs.lora_adapter import AdapterOutput

if TYPE_CHECKING:
    from mergeflow.lora.keys import AdapterModuleKeys


class PeftAdapter(AdapterOutput):
    name: ClassVar[str] = "peft_adapter"
    option_value: ClassVar[str] = "peft"
    weights_name: ClassVar[str] = PEFT_ADAPTER_WEIGHTS_NAME
    key_prefix: ClassVar[str] = PEFT_PREFIX

    def adapter_keys(self, adapter_name: str, modules: Mapping[str, AdapterModuleKeys],
                     saved: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
        return peft_adapter_keys(modules, saved)

    def header_metadata(self, adapter_config: Mapping[str, Any]) -> dict[str, str]:
        from mergeflow.export.write.shard_writer import (
            HEADER_METADATA,  # torch: only when writing
        )

        return dict(HEADER_METADATA)

    def extra_files(self, adapter_config: Mapping[str, Any]) -> list[tuple[str, bytes]]:
        return [(ADAPTER_CONFIG_NAME, (adapter_config_json(adapter_config) + "\n").encode("utf-8"))]

    def check_extra(self, root: Path, record: LoraAdapterJson) -> None:
        data = read_json_strict(root / ADAPTER_CONFIG_NAME, ArtifactInvalidError, ADAPTER_CONFIG_NAME)
        if not isinstance(data, dict):
            raise ArtifactInvalidError(f"{ADAPTER_CONFIG_NAME} must hold a JSON object")
        try:
            settings = settings_from_config_dict(data, ADAPTER_CONFIG_NAME)
        except LoraError as exc:
            raise ArtifactInvalidError(str(exc)) from None
        if (settings.r, settings.lora_alpha) != (record.get("r"), record.get("lora_alpha")):
            raise ArtifactInvalidError(f"{ADAPTER_CONFIG_NAME} r / lora_alpha disagree with the manifest")
        name = data.get("base_model_name_or_path")
        if isinstance(name, str) and (name.startswith(("/", "~")) or "\\" in name):
            raise ArtifactInvalidError(f"{ADAPTER_CONFIG_NAME} names a local path as base_model_name_or_path")
