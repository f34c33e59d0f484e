"""SD3 / SD3.5's ComfyUI LoRA naming: Diffusers' `transformer.<module>.lora_A.weight` / `.lora_B.weight`.

ComfyUI's comfy/lora.py maps MMDiT LoRAs from Diffusers' module names under `transformer.` (its
"regular diffusers sd3 lora format", every module of comfy.utils.mmdit_to_diffusers, SD3.5's dual
attention included), and SD3LoraLoaderMixin has no non-Diffusers converter at all: it reads these
keys as they are and refuses any key without `lora` in it, so no `.alpha` can be written. Each
module's scale is folded into its up instead (ComfyUI then takes scale 1 as well).
"""

from __future__ import annotations

from collections.abc import Sequence

from mergeflow.architectures.original_lora import LoraModule, LoraNaming

PREFIX = "transformer."


def plan(adapted: Sequence[str]) -> list[LoraModule]:
    return [LoraModule(f"{PREFIX}{module}", (module,), alpha=False) for module in adapted]


LORA_NAMING = LoraNaming(
    name="sd3-diffusers",
    transformer_classes=("SD3Transformer2DModel",),
    key_prefix=PREFIX,
    down="lora_A.weight",
    up="lora_B.weight",
    plan=plan,
    diff_refusal=("SD3LoraLoaderMixin.lora_state_dict refuses a file with a key lacking 'lora' "
                  "(`Invalid LoRA checkpoint`): a .diff entry would stop load_lora_weights reading the file"),
)
