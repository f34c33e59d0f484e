"""Wan's ComfyUI LoRA naming: `diffusion_model.` + Wan-AI's module names.

`diffusion_model.blocks.N.self_attn.q.lora_down.weight` / `.lora_up.weight` / `.alpha`, as
ComfyUI's comfy/lora.py reads Wan LoRAs and Diffusers' `_convert_non_diffusers_wan_lora_to_diffusers`
(WanLoraLoaderMixin, picked by any `diffusion_model.` key) converts them. That converter reads a
per-module alpha only inside the blocks (attention and FFN); for the other modules (time and text
embedders, the image embedder, head) a remaining `.alpha` is an error, so their scale is folded into
the up and no alpha is written (ComfyUI then takes scale 1 as well).

Refused: `patch_embedding` (a Conv3d no converter maps).

An extraction's changed biases and other tensors are written as ComfyUI's `.diff_b` / `.diff` entries
(mergeflow.lora.diffs). Diffusers' converter reads `<module>.diff_b` as the module's `lora_B.bias`
(PEFT's lora_bias) for every module this naming writes, and drops norm diffs and the remaining `.diff`
keys with a log line; ComfyUI applies all of them (the norms, `modulation`, `patch_embedding` too).
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from mergeflow.architectures.original_lora import LoraModule, LoraNaming, unnamed

PREFIX = "diffusion_model."
_BLOCK = re.compile(r"^blocks\.(\d+)\.(.+)$")
_IN_BLOCK = {
    "attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v", "attn1.to_out.0": "self_attn.o",
    "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k", "attn2.to_v": "cross_attn.v", "attn2.to_out.0": "cross_attn.o",
    "attn2.add_k_proj": "cross_attn.k_img", "attn2.add_v_proj": "cross_attn.v_img",
    "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2",
}
# Outside the blocks: read without an alpha.
_GLOBAL = {
    "condition_embedder.time_proj": "time_projection.1",
    "condition_embedder.text_embedder.linear_1": "text_embedding.0",
    "condition_embedder.text_embedder.linear_2": "text_embedding.2",
    "condition_embedder.time_embedder.linear_1": "time_embedding.0",
    "condition_embedder.time_embedder.linear_2": "time_embedding.2",
    "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
    "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
    "proj_out": "head.head",
}


def plan(adapted: Sequence[str]) -> list[LoraModule]:
    pairs = {"add_k_proj": "add_v_proj", "add_v_proj": "add_k_proj"}
    img = {m for m in adapted if m.endswith((".attn2.add_k_proj", ".attn2.add_v_proj"))}
    half = sorted(m for m in img if m.rsplit(".", 1)[0] + "." + pairs[m.rsplit(".", 1)[1]] not in img)
    if half:  # Diffusers' converter reads k_img / v_img only as a pair (an I2V LoRA) and refuses one alone
        raise unnamed("Wan", half[0], "Diffusers reads k_img and v_img LoRAs only together")
    out = []
    for module in adapted:
        block = _BLOCK.match(module)
        if block and block[2] in _IN_BLOCK:
            out.append(LoraModule(f"{PREFIX}blocks.{block[1]}.{_IN_BLOCK[block[2]]}", (module,)))
        elif module in _GLOBAL:
            out.append(LoraModule(f"{PREFIX}{_GLOBAL[module]}", (module,), alpha=False))
        else:
            raise unnamed("Wan", module)
    return out


LORA_NAMING = LoraNaming(
    name="wan-diffusion-model",
    transformer_classes=("WanTransformer3DModel",),
    key_prefix=PREFIX,
    down="lora_down.weight",
    up="lora_up.weight",
    plan=plan,
)
