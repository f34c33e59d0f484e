"""Qwen-Image's ComfyUI LoRA naming: `diffusion_model.` + the Diffusers module names.

Qwen's original layout uses Diffusers' names (the single-file map is the identity), so a ComfyUI
Qwen-Image LoRA is `diffusion_model.<module>.lora_down.weight` / `.lora_up.weight` / `.alpha`,
which ComfyUI's comfy/lora.py reads and Diffusers' `_convert_non_diffusers_qwen_lora_to_diffusers`
(QwenImageLoraLoaderMixin, picked by `diffusion_model.` keys or `.alpha` keys) converts, folding
each module's alpha / rank into its weights.
"""

from __future__ import annotations

from collections.abc import Sequence

from mergeflow.architectures.original_lora import LoraModule, LoraNaming

PREFIX = "diffusion_model."


def plan(adapted: Sequence[str]) -> list[LoraModule]:
    return [LoraModule(f"{PREFIX}{module}", (module,)) for module in adapted]


LORA_NAMING = LoraNaming(
    name="qwen-image-diffusion-model",
    transformer_classes=("QwenImageTransformer2DModel",),
    key_prefix=PREFIX,
    down="lora_down.weight",
    up="lora_up.weight",
    plan=plan,
    diff_refusal=("Diffusers' _convert_non_diffusers_qwen_lora_to_diffusers raises on any key it leaves "
                  "(`state_dict should be empty`): a .diff entry would stop load_lora_weights reading the file"),
)
