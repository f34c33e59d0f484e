"""MiniMax H3's ComfyUI LoRA naming: `diffusion_model.` + the native MiniMaxH3DiTModel module names.

`diffusion_model.blocks.N.attn.qkv_proj.lora_down.weight` / `.lora_up.weight` / `.alpha`, as
ai-toolkit writes H3 LoRAs and Diffusers' `_convert_non_diffusers_minimax_h3_lora_to_diffusers`
(MiniMaxH3LoraLoaderMixin, picked by `diffusion_model.` keys) converts them, folding each alpha.
The native model fuses q, k, v into `attn.qkv_proj` ([q; k; v] rows): its LoRA is the exact
block-structured LoRA of the fused weight, which the converter splits back (shared down, the up
in thirds). The native SwiGLU input `mlp.fc1` holds [gate; value] where Diffusers' `ff.net.0.proj`
holds [value; gate]: the up's row halves are exchanged (the down is untouched).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from mergeflow.architectures.original_lora import LoraModule, LoraNaming, unnamed

PREFIX = "diffusion_model."
_BLOCKS = ((re.compile(r"^transformer_blocks\.(\d+)\.(.+)$"), "blocks"),
           (re.compile(r"^token_refiner\.refiner_blocks\.(\d+)\.(.+)$"), "token_refiner.blocks"))
_IN_BLOCK = {"attn.to_out.0": "attn.out_proj", "ff.net.2": "mlp.fc2", "adaln_proj.linear": "adaln_proj.linear"}
_QKV = ("attn.to_q", "attn.to_k", "attn.to_v")
_STANDALONE = {
    "proj_in": "video_patch_proj",
    "audio_proj_in": "audio_patch_proj",
    "context_embedder": "condition_proj",
    "time_embedder.linear_1": "time_embedder.proj_in",
    "time_embedder.linear_2": "time_embedder.proj_out",
    "norm_out.linear": "final_layer.adaln_proj.linear",
    "proj_out": "final_layer.video_out",
    "audio_proj_out": "final_layer.audio_out",
}


def _module(module: str) -> LoraModule:
    if module in _STANDALONE:
        return LoraModule(f"{PREFIX}{_STANDALONE[module]}", (module,))
    for pattern, native in _BLOCKS:
        match = pattern.match(module)
        if not match:
            continue
        block, inner = f"{native}.{match[1]}", match[2]
        diffusers_block = module[: -len(inner) - 1]
        if inner in _IN_BLOCK:
            return LoraModule(f"{PREFIX}{block}.{_IN_BLOCK[inner]}", (module,))
        if inner == "ff.net.0.proj":
            return LoraModule(f"{PREFIX}{block}.mlp.fc1", (module,), swap_halves=True)
        if inner in _QKV:
            # q, k and v listed whatever is adapted: a part without a LoRA is a zero block of the up.
            return LoraModule(f"{PREFIX}{block}.attn.qkv_proj", tuple(f"{diffusers_block}.{p}" for p in _QKV))
    raise unnamed("MiniMax H3", module)


def plan(adapted: Sequence[str]) -> list[LoraModule]:
    modules: dict[str, LoraModule] = {}
    for module in adapted:
        found = _module(module)
        modules.setdefault(found.stem, found)
    return list(modules.values())


LORA_NAMING = LoraNaming(
    name="minimax-h3-diffusion-model",
    transformer_classes=("MiniMaxH3Transformer3DModel",),
    key_prefix=PREFIX,
    down="lora_down.weight",
    up="lora_up.weight",
    plan=plan,
    diff_refusal=("Diffusers' _convert_non_diffusers_minimax_h3_lora_to_diffusers raises on any key it does not "
                  "convert (`state_dict should be empty`): a .diff entry would stop load_lora_weights reading the file"),
)
