"""Names and metadata of exported adapters: PEFT's adapter directory and Diffusers' LoRA file.

PEFT (`get_peft_model_state_dict`) saves `base_model.model.<module>.lora_A.weight` with the adapter
name removed; DoRA magnitudes lose their `.weight` suffix; `modules_to_save` copies are saved under
their plain module name. Diffusers' pipeline `save_lora_weights` writes
`pytorch_lora_weights.safetensors` with `<component>.<module>.lora_A.weight` keys and the LoraConfig
as JSON under the header key `lora_adapter_metadata`, every field prefixed with `<component>.`
(`_pack_dict_with_prefix`); without it `load_lora_weights` infers alpha = r.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from mergeflow.errors import LoraError
from mergeflow.lora.config import AdapterConfig
from mergeflow.lora.keys import ADAPTER_KINDS, PEFT_PREFIX, AdapterModuleKeys

PEFT_ADAPTER_WEIGHTS_NAME = "adapter_model.safetensors"
DIFFUSERS_LORA_WEIGHTS_NAME = "pytorch_lora_weights.safetensors"
DIFFUSERS_METADATA_KEY = "lora_adapter_metadata"  # diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY

_SUFFIX = {
    "lora_A": "lora_A.weight",
    "lora_B": "lora_B.weight",
    "lora_B_bias": "lora_B.bias",
    "lora_magnitude_vector": "lora_magnitude_vector",
}


def _suffix(kind: str) -> str:
    if kind not in _SUFFIX:
        raise LoraError(f"unknown adapter part {kind!r}; expected one of {list(ADAPTER_KINDS)}")
    return _SUFFIX[kind]


def peft_adapter_key(module: str, kind: str) -> str:
    """Key of one adapter part in PEFT's `adapter_model.safetensors`."""
    return f"{PEFT_PREFIX}{module}.{_suffix(kind)}"


def peft_saved_module_key(module: str, param: str) -> str:
    """Key of a `modules_to_save` parameter in PEFT's `adapter_model.safetensors`."""
    return f"{PEFT_PREFIX}{module}.{param}"


def diffusers_lora_key(module: str, kind: str, component: str = "transformer") -> str:
    """Key of one adapter part in Diffusers' `pytorch_lora_weights.safetensors`."""
    return f"{component}.{module}.{_suffix(kind)}"


def peft_adapter_keys(
    modules: Mapping[str, AdapterModuleKeys], saved: Mapping[str, Mapping[str, str]] | None = None
) -> dict[str, str]:
    """Output key -> checkpoint key for one adapter's PEFT file (other adapters are simply not passed)."""
    mapping = {peft_adapter_key(m, kind): src for m, item in modules.items() for kind, src in item.sources().items()}
    for module, params in (saved or {}).items():
        for param, src in params.items():
            out = peft_saved_module_key(module, param)
            if out in mapping:
                raise LoraError(f"{module} is both LoRA-adapted and in modules_to_save; PEFT cannot save that")
            mapping[out] = src
    return mapping


def diffusers_lora_keys(modules: Mapping[str, AdapterModuleKeys], component: str = "transformer") -> dict[str, str]:
    """Output key -> checkpoint key for one adapter's Diffusers LoRA file."""
    return {
        diffusers_lora_key(module, kind, component): src
        for module, item in modules.items()
        for kind, src in item.sources().items()
    }


def _json_ready(config_dict: AdapterConfig) -> AdapterConfig:
    ready = {}
    for key, value in config_dict.items():
        # Diffusers' writer turns sets into lists; sorting keeps the bytes reproducible.
        ready[key] = sorted(value) if isinstance(value, (set, frozenset)) else value
    return ready


def adapter_config_json(config_dict: Mapping[str, Any]) -> str:
    """`adapter_config.json` text as PeftConfig.save_pretrained writes it (indent 2, sorted keys)."""
    return json.dumps(_json_ready(config_dict), indent=2, sort_keys=True)


def diffusers_lora_metadata(config_dict: Mapping[str, Any], component: str = "transformer") -> dict[str, str]:
    """Safetensors header metadata for `pytorch_lora_weights.safetensors` that keeps alpha and patterns."""
    if config_dict.get("modules_to_save"):
        raise LoraError("Diffusers' LoRA format cannot carry modules_to_save; export the PEFT adapter instead")
    packed = {f"{component}.{key}": value for key, value in _json_ready(config_dict).items()}
    return {"format": "pt", DIFFUSERS_METADATA_KEY: json.dumps(packed, indent=2, sort_keys=True)}
