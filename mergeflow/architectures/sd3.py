"""SD3 / SD3.5 (Stability's MMDiT): the original single-file layout.

The exact inverse of Diffusers' `convert_sd3_transformer_checkpoint_to_diffusers`
(diffusers/loaders/single_file_utils.py), which `SD3Transformer2DModel.from_single_file` runs:

- `joint_blocks.N.{x_block,context_block}.attn.qkv` (and SD3.5 medium's `x_block.attn2.qkv`) fuse
  q, k, v row-wise, weights and biases: the converter `torch.chunk`s them in three;
- RMS qk-norm weights (`ln_q` / `ln_k`, SD3.5) and everything else are plain renames;
- the last block's context stream is "pre only": no `attn.proj` and no `mlp`, and its
  `adaLN_modulation` is (shift, scale) where Diffusers' `AdaLayerNormContinuous` is (scale, shift),
  so the converter exchanges its halves; so does it for `final_layer.adaLN_modulation`.

Which blocks have dual attention, and whether qk-norm is on, are read from the Diffusers names as
the converter reads them from the original ones, so the map needs no config value and works at
any depth (SD3 medium 24 blocks, SD3.5 large 38).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from mergeflow.architectures.quantization import FP8Rule
from mergeflow.architectures.original_layout import (
    OriginalLayout,
    OriginalTensor,
    Shape,
)
from mergeflow.errors import SchemaMismatchError

# Stability's published files (sd3_medium.safetensors, sd3.5_large.safetensors) and their reference
# loader (Stability-AI/sd3.5 `sd3_infer.py`) key the MMDiT under this prefix; kohya's SD3 saver does
# the same. Diffusers strips it (`convert_sd3_...` and `infer_diffusers_model_type` accept both) and
# ComfyUI detects it, so every reader takes the prefixed file, while the bare keys would not load in
# Stability's own reference code.
PREFIX = "model.diffusion_model."

_BLOCK = re.compile(r"^transformer_blocks\.(\d+)\.")

# Diffusers name -> original name, outside the joint blocks (whole tensors, weight and bias).
_TOP_LEVEL: dict[str, str] = {
    "pos_embed.proj": "x_embedder.proj",
    "time_text_embed.timestep_embedder.linear_1": "t_embedder.mlp.0",
    "time_text_embed.timestep_embedder.linear_2": "t_embedder.mlp.2",
    "context_embedder": "context_embedder",
    "time_text_embed.text_embedder.linear_1": "y_embedder.mlp.0",
    "time_text_embed.text_embedder.linear_2": "y_embedder.mlp.2",
    "proj_out": "final_layer.linear",
}
# Inside block N: Diffusers module -> original module, for the modules every block has.
_BLOCK_MODULES: dict[str, str] = {
    "attn.to_out.0": "x_block.attn.proj",
    "norm1.linear": "x_block.adaLN_modulation.1",
    "ff.net.0.proj": "x_block.mlp.fc1",
    "ff.net.2": "x_block.mlp.fc2",
}
# ...those only the context stream of a block that is not the last has (context_pre_only=False).
_CONTEXT_MODULES: dict[str, str] = {
    "attn.to_add_out": "context_block.attn.proj",
    "norm1_context.linear": "context_block.adaLN_modulation.1",
    "ff_context.net.0.proj": "context_block.mlp.fc1",
    "ff_context.net.2": "context_block.mlp.fc2",
}
# The fused projections: original module -> its Diffusers q, k, v modules (in row order).
_QKV: dict[str, tuple[str, str, str]] = {
    "x_block.attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "context_block.attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
_QK_NORM: dict[str, str] = {
    "attn.norm_q": "x_block.attn.ln_q",
    "attn.norm_k": "x_block.attn.ln_k",
    "attn.norm_added_q": "context_block.attn.ln_q",
    "attn.norm_added_k": "context_block.attn.ln_k",
}
_ATTN2_QK_NORM: dict[str, str] = {"attn2.norm_q": "x_block.attn2.ln_q", "attn2.norm_k": "x_block.attn2.ln_k"}
_WB = ("weight", "bias")


def _qkv(name: str, parts: tuple[str, ...], shapes: Mapping[str, Shape]) -> OriginalTensor:
    # The converter splits the fused tensor in three equal row blocks: unequal parts would load
    # into the wrong projections, so they are refused here rather than written.
    rows = {tuple(shapes[p])[:1] for p in parts if p in shapes}
    if len(rows) > 1:
        raise SchemaMismatchError(f"{name}: {', '.join(parts)} differ in rows; the SD3 loader splits it in three equal parts")
    return OriginalTensor(name, parts, "cat")


def _block(i: int, last: bool, dual: bool, qk_norm: bool, shapes: Mapping[str, Shape]) -> list[OriginalTensor]:
    src, dst = f"transformer_blocks.{i}.", f"{PREFIX}joint_blocks.{i}."
    out: list[OriginalTensor] = []
    qkv = dict(_QKV)
    modules = dict(_BLOCK_MODULES)
    if not last:
        modules.update(_CONTEXT_MODULES)
    norms = dict(_QK_NORM) if qk_norm else {}
    if dual:  # SD3.5 medium's second self-attention on the image stream
        qkv["x_block.attn2.qkv"] = ("attn2.to_q", "attn2.to_k", "attn2.to_v")
        modules["attn2.to_out.0"] = "x_block.attn2.proj"
        if qk_norm:
            norms.update(_ATTN2_QK_NORM)
    for fused, parts in qkv.items():
        for p in _WB:
            out.append(_qkv(f"{dst}{fused}.{p}", tuple(f"{src}{q}.{p}" for q in parts), shapes))
    for d, o in modules.items():
        out += [OriginalTensor(f"{dst}{o}.{p}", (f"{src}{d}.{p}",)) for p in _WB]
    out += [OriginalTensor(f"{dst}{o}.weight", (f"{src}{d}.weight",)) for d, o in norms.items()]
    if last:  # the pre-only context stream's (shift, scale) modulation: halves exchanged
        out += [OriginalTensor(f"{dst}context_block.adaLN_modulation.1.{p}", (f"{src}norm1_context.linear.{p}",),
                               "swap_halves") for p in _WB]
    return out


def plan(shapes: Mapping[str, Shape], params: Mapping[str, Any]) -> list[OriginalTensor]:
    blocks = sorted({int(m.group(1)) for k in shapes if (m := _BLOCK.match(k))})
    if not blocks:
        raise SchemaMismatchError("the sd3 layout found no transformer_blocks.N tensors in the checkpoint")
    depth = blocks[-1] + 1  # a missing block is then named by checked_plan as a missing tensor
    # As the converter decides: qk-norm for all blocks if any has it, attn2 per block where present.
    qk_norm = any(".attn.norm_q." in k for k in shapes)
    dual = {i for i in blocks if f"transformer_blocks.{i}.attn2.to_q.weight" in shapes}
    out = [OriginalTensor(f"{PREFIX}pos_embed", ("pos_embed.pos_embed",))]
    out += [OriginalTensor(f"{PREFIX}{o}.{p}", (f"{d}.{p}",)) for d, o in _TOP_LEVEL.items() for p in _WB]
    for i in range(depth):
        out += _block(i, i == depth - 1, i in dual, qk_norm, shapes)
    # AdaLayerNormContinuous (scale, shift) -> the original final layer's (shift, scale).
    out += [OriginalTensor(f"{PREFIX}final_layer.adaLN_modulation.1.{p}", (f"norm_out.linear.{p}",), "swap_halves")
            for p in _WB]
    return out


def architecture(config: Mapping[str, Any]) -> str:
    # SwarmUI's (Stability's) ModelSpec ids. Knowable from the config as kohya's sd3_utils tells the
    # variants apart: no qk-norm is SD3 medium; with qk-norm, dual-attention blocks mark SD3.5 medium
    # and their absence SD3.5 large (Large Turbo has the same weights' shapes: indistinguishable).
    if not config.get("qk_norm"):
        return "stable-diffusion-v3-medium"
    if config.get("dual_attention_layers"):
        return "stable-diffusion-v3.5-medium"
    return "stable-diffusion-v3.5-large"


ORIGINAL = OriginalLayout(
    name="sd3",
    transformer_classes=("SD3Transformer2DModel",),
    plan=plan,
    architecture=architecture,
    implementation="https://github.com/Stability-AI/sd3.5",  # SAI's MMDiT-X reference (SD3 and SD3.5)
    resolution=lambda config: "1024x1024",  # every SD3 / SD3.5 release is trained for 1024²
    # --quantize fp8: the blocks' linear weights; modulation and norms stay bf16 (see quantization.py).
    fp8=FP8Rule(blocks=r"(model\.diffusion_model\.)?joint_blocks\.\d+\.", keep=r"adaLN_modulation|norm"),
)
