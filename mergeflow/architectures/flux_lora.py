"""Flux's ComfyUI LoRA naming: kohya's `lora_unet_<BFL module, dots as underscores>`.

`lora_down.weight` / `lora_up.weight` / `alpha` per module, as kohya's sd-scripts write it and
Diffusers' `_convert_kohya_flux_lora_to_diffusers` (FluxLoraLoaderMixin, picked by any
`.lora_down.weight` key) and ComfyUI's comfy/lora.py read it (ComfyUI keys every weight of its BFL
model as `lora_unet_` + the weight's name with dots as underscores). BFL fuses attention's q, k, v
into `qkv` (double blocks, image and text side) and q, k, v with the MLP input into single blocks'
`linear1`: the LoRA of a fused module is the exact block-structured LoRA of the fused weight
(down: the parts' downs stacked; up: their ups on the block diagonal; rank: the sum).

Outside the blocks (what `target_modules: all-linear` adds): the embedders `img_in`, `txt_in`,
`time_in` / `vector_in` / `guidance_in` (`in_layer`, `out_layer`) keep their alpha, which both
loaders read. The final layer (`final_layer_linear`, `final_layer_adaLN_modulation_1`) is written
without one: Diffusers' converter copies its down and up as they are and discards a final-layer
alpha, while ComfyUI would apply it, so the scale is folded into the up and both apply scale 1.
BFL's final modulation holds (shift, scale) where Diffusers' `norm_out.linear` holds (scale,
shift): its up's row halves are exchanged, which Diffusers' `swap_scale_shift` undoes on load.
Diffusers' converter names these modules without `transformer.`, so its `load_lora_weights` leaves
them out (only the in-block modules load there); ComfyUI applies them all.

An extraction's changed biases and norms are written as ComfyUI's `.diff_b` / `.diff` entries
(mergeflow.lora.diffs): `<stem>.diff_b` for the bias of a LoRA'd module (a fused module's bias diff
is its parts' diffs stacked), `diffusion_model.<BFL key>.diff` for the others (the RMSNorms' `.scale`
has no `lora_unet_` name). Diffusers' kohya converter filters both out with an info log
(lora_conversion_utils.py: `diff_b` keys and norm `.diff` keys "currently unsupported"), so
load_lora_weights still reads the file's LoRA; ComfyUI applies them.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from mergeflow.architectures.original_lora import LoraModule, LoraNaming, unnamed

PREFIX = "lora_unet_"
_DOUBLE = re.compile(r"^transformer_blocks\.(\d+)\.(.+)$")
_SINGLE = re.compile(r"^single_transformer_blocks\.(\d+)\.(.+)$")

# Diffusers module inside transformer_blocks.N -> BFL module inside double_blocks.N.
_DOUBLE_NAMES = {
    "attn.to_out.0": "img_attn_proj",
    "attn.to_add_out": "txt_attn_proj",
    "ff.net.0.proj": "img_mlp_0",
    "ff.net.2": "img_mlp_2",
    "ff_context.net.0.proj": "txt_mlp_0",
    "ff_context.net.2": "txt_mlp_2",
    "norm1.linear": "img_mod_lin",
    "norm1_context.linear": "txt_mod_lin",
}
_DOUBLE_FUSED = {
    "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
_SINGLE_NAMES = {"proj_out": "linear2", "norm.linear": "modulation_lin"}
_SINGLE_FUSED = {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}
# Diffusers module outside the blocks -> BFL module: the names kohya's converter maps back.
_EMBEDDERS = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_text_embed.timestep_embedder.linear_1": "time_in_in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in_out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in_in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in_out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in_in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in_out_layer",
}
# The final layer: Diffusers' converter reads no alpha there (see the module docstring), so the
# scale is folded into the up; the modulation's (scale, shift) halves become BFL's (shift, scale).
_FINAL = {
    "proj_out": LoraModule(f"{PREFIX}final_layer_linear", ("proj_out",), alpha=False),
    "norm_out.linear": LoraModule(f"{PREFIX}final_layer_adaLN_modulation_1", ("norm_out.linear",), alpha=False,
                                  swap_halves=True),
}


def _block_module(block: str, index: str, inner: str, names: dict[str, str],
                  fused: dict[str, tuple[str, ...]], diffusers_block: str) -> LoraModule | None:
    stem = f"{PREFIX}{block}_{index}_"
    if inner in names:
        return LoraModule(stem + names[inner], (f"{diffusers_block}.{index}.{inner}",))
    for bfl, parts in fused.items():
        if inner in parts:
            # Every part of the fused weight is listed, adapted or not: a part the adapter does not
            # train is a zero block of the up (its rows, no rank), so the fused LoRA stays exact.
            return LoraModule(stem + bfl, tuple(f"{diffusers_block}.{index}.{p}" for p in parts))
    return None


def plan(adapted: Sequence[str]) -> list[LoraModule]:
    modules: dict[str, LoraModule] = {}
    for module in adapted:
        double, single = _DOUBLE.match(module), _SINGLE.match(module)
        found = None
        if module in _EMBEDDERS:
            found = LoraModule(PREFIX + _EMBEDDERS[module], (module,))
        elif module in _FINAL:
            found = _FINAL[module]
        elif double:
            found = _block_module("double_blocks", double[1], double[2], _DOUBLE_NAMES, _DOUBLE_FUSED,
                                  "transformer_blocks")
        elif single:
            found = _block_module("single_blocks", single[1], single[2], _SINGLE_NAMES, _SINGLE_FUSED,
                                  "single_transformer_blocks")
        if found is None:
            raise unnamed("Flux", module)
        modules.setdefault(found.stem, found)
    adapted_set = set(adapted)
    # A fused module keeps only if some part is adapted; its listed parts that are not become zero blocks.
    return [m for m in modules.values() if adapted_set & set(m.parts)]


LORA_NAMING = LoraNaming(
    name="flux-kohya",
    transformer_classes=("FluxTransformer2DModel",),
    key_prefix=PREFIX,
    down="lora_down.weight",
    up="lora_up.weight",
    plan=plan,
)
