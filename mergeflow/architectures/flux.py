"""FLUX.1 (dev and schnell): Black Forest Labs' original single-file layout.

The exact inverse of Diffusers' `convert_flux_transformer_checkpoint_to_diffusers`
(`diffusers/loaders/single_file_utils.py`), which is what `from_single_file` and ComfyUI read:

- `double_blocks.N.{img,txt}_attn.qkv` fuse q, k, v (image: `to_*`; text: `add_*_proj`), weights
  and biases; the converter `torch.chunk`s them in three, so the rows are q, k, v in that order;
- `single_blocks.N.linear1` fuses q, k, v and `proj_mlp` (the converter `torch.split`s q|k|v|mlp);
  `linear2` is `proj_out`;
- `final_layer.adaLN_modulation.1` is `norm_out.linear` with its halves exchanged: BFL's
  modulation is (shift, scale), Diffusers' AdaLayerNormContinuous is (scale, shift), and the
  converter's `swap_scale_shift` exchanges them; exchanging again restores BFL's order;
- `guidance_in` exists only where the model has a guidance embedder (dev); schnell has none, and
  the converter and `infer_diffusers_model_type` key dev versus schnell on its presence.

Block counts come from the Diffusers names, never from a fixed depth. The keys carry no
`model.diffusion_model.` prefix: the converter strips it where present, and BFL's own releases
(and `CHECKPOINT_KEY_NAMES["flux"]`'s first key) have none.
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

_DOUBLE = re.compile(r"transformer_blocks\.(\d+)\.")
_SINGLE = re.compile(r"single_transformer_blocks\.(\d+)\.")

# Whole tensors outside the blocks: Diffusers name -> BFL name.
_GLOBAL: dict[str, str] = {
    "time_text_embed.timestep_embedder.linear_1": "time_in.in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in.out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in.in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in.out_layer",
    "context_embedder": "txt_in",
    "x_embedder": "img_in",
    "proj_out": "final_layer.linear",
}
# Present only with guidance_embeds (FLUX.1 dev); the Diffusers names tell, not the config.
_GUIDANCE: dict[str, str] = {
    "time_text_embed.guidance_embedder.linear_1": "guidance_in.in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in.out_layer",
}

# Whole tensors of a double block: Diffusers suffix -> BFL suffix (under `double_blocks.N.`).
_DOUBLE_RENAMES: dict[str, str] = {
    "norm1.linear.weight": "img_mod.lin.weight",
    "norm1.linear.bias": "img_mod.lin.bias",
    "norm1_context.linear.weight": "txt_mod.lin.weight",
    "norm1_context.linear.bias": "txt_mod.lin.bias",
    "attn.norm_q.weight": "img_attn.norm.query_norm.scale",
    "attn.norm_k.weight": "img_attn.norm.key_norm.scale",
    "attn.norm_added_q.weight": "txt_attn.norm.query_norm.scale",
    "attn.norm_added_k.weight": "txt_attn.norm.key_norm.scale",
    "ff.net.0.proj.weight": "img_mlp.0.weight",
    "ff.net.0.proj.bias": "img_mlp.0.bias",
    "ff.net.2.weight": "img_mlp.2.weight",
    "ff.net.2.bias": "img_mlp.2.bias",
    "ff_context.net.0.proj.weight": "txt_mlp.0.weight",
    "ff_context.net.0.proj.bias": "txt_mlp.0.bias",
    "ff_context.net.2.weight": "txt_mlp.2.weight",
    "ff_context.net.2.bias": "txt_mlp.2.bias",
    "attn.to_out.0.weight": "img_attn.proj.weight",
    "attn.to_out.0.bias": "img_attn.proj.bias",
    "attn.to_add_out.weight": "txt_attn.proj.weight",
    "attn.to_add_out.bias": "txt_attn.proj.bias",
}
# Fused tensors of a double block: BFL stem -> Diffusers stems, in row order.
_DOUBLE_FUSED: dict[str, tuple[str, ...]] = {
    "img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}

_SINGLE_RENAMES: dict[str, str] = {
    "norm.linear.weight": "modulation.lin.weight",
    "norm.linear.bias": "modulation.lin.bias",
    "attn.norm_q.weight": "norm.query_norm.scale",
    "attn.norm_k.weight": "norm.key_norm.scale",
    "proj_out.weight": "linear2.weight",
    "proj_out.bias": "linear2.bias",
}
_SINGLE_FUSED: dict[str, tuple[str, ...]] = {
    "linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
}


def _blocks(shapes: Mapping[str, Shape], pattern: re.Pattern[str]) -> range:
    # `match` anchors at the start, so `transformer_blocks.` never matches a single block's name.
    # Every index below the highest is planned: the converter reads blocks 0..N-1, so a missing
    # block is a tensor checked_plan names as lacking, not a gap the file would carry.
    found = [int(m.group(1)) for name in shapes if (m := pattern.match(name))]
    return range(max(found) + 1 if found else 0)


def _block(prefix: str, target: str, renames: Mapping[str, str],
           fused: Mapping[str, tuple[str, ...]]) -> list[OriginalTensor]:
    out = [OriginalTensor(f"{target}{bfl}", (f"{prefix}{ours}",)) for ours, bfl in renames.items()]
    for bfl, stems in fused.items():
        for kind in ("weight", "bias"):
            out.append(OriginalTensor(f"{target}{bfl}.{kind}", tuple(f"{prefix}{s}.{kind}" for s in stems), "cat"))
    return out


def plan(shapes: Mapping[str, Shape], params: Mapping[str, Any]) -> list[OriginalTensor]:
    out: list[OriginalTensor] = []
    globals_ = dict(_GLOBAL)
    # Only the embedder's presence decides; a half-present one is left for checked_plan to refuse.
    if any(name.startswith("time_text_embed.guidance_embedder.") for name in shapes):
        globals_.update(_GUIDANCE)
    for ours, bfl in globals_.items():
        out += [OriginalTensor(f"{bfl}.{kind}", (f"{ours}.{kind}",)) for kind in ("weight", "bias")]
    doubles, singles = _blocks(shapes, _DOUBLE), _blocks(shapes, _SINGLE)
    if not doubles or not singles:
        # The converter counts blocks from the highest index it finds and fails on none at all.
        raise SchemaMismatchError("the flux original layout needs transformer_blocks.N and single_transformer_blocks.N; "
                                  f"the checkpoint has {len(doubles)} double and {len(singles)} single block(s)")
    for i in doubles:
        out += _block(f"transformer_blocks.{i}.", f"double_blocks.{i}.", _DOUBLE_RENAMES, _DOUBLE_FUSED)
    for i in singles:
        out += _block(f"single_transformer_blocks.{i}.", f"single_blocks.{i}.", _SINGLE_RENAMES, _SINGLE_FUSED)
    out += [OriginalTensor(f"final_layer.adaLN_modulation.1.{kind}", (f"norm_out.linear.{kind}",), "swap_halves")
            for kind in ("weight", "bias")]
    return out


def architecture(config: Mapping[str, Any]) -> str:
    # ModelSpec's names (kohya sd-scripts' sai_model_spec.py: ARCH_FLUX_1_DEV/SCHNELL): the guidance embedder is
    # what tells dev (guidance-distilled) from schnell (timestep-distilled), as in Diffusers' own
    # infer_diffusers_model_type. Fill/Depth/Redux variants share dev's keys and are not told apart.
    return "flux-1-dev" if config.get("guidance_embeds", False) else "flux-1-schnell"


ORIGINAL = OriginalLayout(
    name="flux",
    transformer_classes=("FluxTransformer2DModel",),
    plan=plan,
    architecture=architecture,
    implementation="https://github.com/black-forest-labs/flux",
    # FLUX.1's native resolution; kohya's sai_model_spec records 1024x1024 for every Flux.
    resolution=lambda config: "1024x1024",
    # --quantize fp8: the blocks' linear weights; modulation and norms stay bf16 (see quantization.py).
    fp8=FP8Rule(blocks=r"(double_blocks|single_blocks)\.\d+\.", keep=r"_mod\.|modulation|norm"),
)
